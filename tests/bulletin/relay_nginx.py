"""A real nginx relay (``deploy/relay/relay.conf.template``) on loopback, for the relay tests and bench_relay.

:class:`Nginx` renders the template as the official nginx image does (``${STITCH_RELAY_*}`` replaced, nginx's own
``$variables`` kept), wraps it in a minimal ``nginx.conf`` whose pid, logs and temp folders lie in the given
folder, starts ``nginx -g 'daemon off;'`` and waits for its port. :data:`NGINX` is the binary (None: not
installed; ``make venv`` installs Debian's ``nginx``).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "deploy" / "relay" / "relay.conf.template"
#: The nginx binary, or None when nginx is not installed.
NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
NO_NGINX = "nginx is not installed (apt-get install nginx; `make venv` does): the relay tests need a real nginx"
_PLACEHOLDER = re.compile(r"\$\{(STITCH_RELAY_[A-Z_]+)\}")


def render(template: str, values: dict[str, str]) -> str:
    """``template`` with each ``${NAME}`` in ``values`` replaced (envsubst's rule for the set variables only).

    Raises:
        KeyError: the template names a ``STITCH_RELAY_*`` variable ``values`` lacks.
    """
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Nginx:
    """nginx running the relay configuration in front of ``origin`` (host:port), in folder ``root``.

    Args:
        origin: the bulletin as ``host:port``.
        root: an empty folder for the configuration, the caches, logs and temp files.
        auth_ttl: STITCH_RELAY_AUTH_TTL (nginx time, e.g. ``"5s"``).
        fetch_timeout: STITCH_RELAY_FETCH_TIMEOUT.
        workers: nginx worker processes.

    Raises:
        RuntimeError: nginx is missing or did not start (its error log attached).
    """

    def __init__(
        self, origin: str, root: Path, *, auth_ttl: str = "5s", fetch_timeout: str = "120s", workers: int = 1
    ) -> None:
        if NGINX is None:
            raise RuntimeError(NO_NGINX)
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cache_dir = root / "objects"
        self.error_log = root / "error.log"
        values = {
            "STITCH_RELAY_LISTEN": f"127.0.0.1:{self.port}",
            "STITCH_RELAY_ORIGIN": origin,
            "STITCH_RELAY_CACHE_DIR": str(self.cache_dir),
            "STITCH_RELAY_CACHE_SIZE": "1g",
            "STITCH_RELAY_AUTH_DIR": str(root / "auth"),
            "STITCH_RELAY_AUTH_TTL": auth_ttl,
            "STITCH_RELAY_FETCH_TIMEOUT": fetch_timeout,
        }
        (root / "relay.conf").write_text(render(TEMPLATE.read_text(), values))
        temp = "\n".join(
            f"    {kind}_temp_path {root / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        user = f"user {pwd.getpwuid(os.geteuid()).pw_name};\n" if os.geteuid() == 0 else ""
        (root / "nginx.conf").write_text(
            f"{user}worker_processes {workers};\npid {root / 'nginx.pid'};\nerror_log {self.error_log} warn;\n"
            "events { worker_connections 4096; }\n"
            f"http {{\n    access_log off;\n{temp}\n    include {root / 'relay.conf'};\n}}\n"
        )
        self.proc = subprocess.Popen(
            [NGINX, "-p", str(root), "-c", str(root / "nginx.conf"), "-e", str(self.error_log), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    log = self.error_log.read_text() if self.error_log.exists() else ""
                    raise RuntimeError(f"nginx did not start: {log[-2000:]}") from None
                time.sleep(0.02)

    def cached_files(self) -> list[Path]:
        """The files of cached objects (one per object)."""
        return [p for p in self.cache_dir.rglob("*") if p.is_file()] if self.cache_dir.exists() else []

    def stop(self) -> None:
        """Stop nginx (fast shutdown) and wait for it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
