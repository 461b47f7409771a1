"""Shared-memory files that engines killed by the tests leave in /dev/shm, removed.

An engine process that ends without its own cleanup (the tests' fault injection exits a worker
with ``os._exit``; a SIGKILL after the grace period) leaves its shared-memory segments behind:
vLLM's broadcast queues and SGLang's are ``multiprocessing.shared_memory`` files
(``psm_<hex>``, 24-240 MiB each), plus SGLang's and vLLM's own named segments. /dev/shm is
memory, so a CI-like run ended with ~0.8 GB of them held until the host rebooted, on a host
that ran out of memory. :func:`remove_orphaned_shm` removes those created during this test
session that no live process maps or holds open (segments of processes still exiting are left
for a later call; those of other users' processes, whose maps this one cannot read, are not
this session's and cannot be removed).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SHM = Path("/dev/shm")
#: Name prefixes of the engines' shared-memory files (Python's SharedMemory, vLLM's and SGLang's own).
ENGINE_PREFIXES = ("psm_", "vllm_", "sgl_", "sglang_")
#: When this test session began (files older than this are never touched).
SESSION_START = time.time()


def _files_in_use() -> set[str]:
    """Paths under /dev/shm that some live process maps or has open."""
    used: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for line in (proc / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)  # address, perms, offset, device, inode[, path]
                if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                    used.add(fields[5].removesuffix(" (deleted)"))
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    used.add(target)
        except OSError:  # the process ended meanwhile, or is not ours to read
            continue
    return used


def remove_orphaned_shm() -> list[str]:
    """Remove the engines' shared-memory files made since :data:`SESSION_START` that no live
    process uses; returns their names. No-op without /dev/shm."""
    if not SHM.is_dir():
        return []
    candidates = [p for p in SHM.iterdir() if p.name.startswith(ENGINE_PREFIXES) and _made_since(p, SESSION_START)]
    if not candidates:
        return []
    used = _files_in_use()
    removed = []
    for path in candidates:
        if str(path) in used:
            continue
        try:
            path.unlink()
        except OSError:  # gone meanwhile (a worker still exiting removed it), or another user's
            continue
        removed.append(path.name)
    return removed


def _made_since(path: Path, since: float) -> bool:
    try:
        return path.is_file() and path.stat().st_mtime >= since
    except OSError:  # removed meanwhile
        return False
