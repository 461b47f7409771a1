"""DESIGN.md's map of modules is the one list of them: every module is on it, and everything on it exists.

The map is the fenced block under "## Packages and modules"; its grammar:

- a line at column 0 opens a folder (``proto/``, ``tests/``) and says what it is;
- a line indented by two spaces lists files of that folder before its first run of two spaces (then
  what they hold and the process they run in): comma-separated, each a path under the folder, a bare
  name sharing the folder of the name before it (``engines/vllm/layout.py, weights.py``), a
  parenthesised part left out (``_condcoder.c (+ _condmodel.h)``);
- a line indented further continues the text of the line above.

Every module of proto, trainer_client, bulletin and sidecar (subfolders included) and every top-level
module of demo and tests/support must be listed; ``__init__.py`` files are not.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Packages and modules"
#: Folder -> the glob of the modules that must be on the map.
MAPPED = {
    "proto": "**/*.py",
    "trainer_client": "**/*.py",
    "bulletin": "**/*.py",
    "sidecar": "**/*.py",
    "demo": "*.py",
    "tests/support": "*.py",
}


def map_block(text: str) -> list[str]:
    """The lines of the fenced block that follows :data:`HEADING`."""
    after = text.split(HEADING, 1)[1]
    block = re.search(r"^```[^\n]*\n(.*?)^```", after, re.DOTALL | re.MULTILINE)
    assert block is not None, f"no fenced block under {HEADING!r} in DESIGN.md"
    return block[1].splitlines()


def listed_files(lines: list[str]) -> dict[str, int]:
    """Repository path -> line number (in the block) of each file the map lists."""
    files: dict[str, int] = {}
    folder = None
    for number, line in enumerate(lines, 1):
        if line and not line[0].isspace():
            folder = line.split()[0].rstrip("/")
        elif line.startswith("  ") and not line.startswith("   ") and line.strip():
            assert folder is not None, f"map line {number} lists files before any folder: {line!r}"
            names = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
            shared = ""
            for name in re.sub(r"\([^)]*\)", "", names).split(","):
                name = name.strip()
                if not name:
                    continue
                if "/" in name:
                    shared = name.rsplit("/", 1)[0] + "/"
                else:
                    name = shared + name
                files[f"{folder}/{name}"] = number
    return files


def modules_on_disk() -> set[str]:
    """Repository path of every module the map must list."""
    return {
        path.relative_to(ROOT).as_posix()
        for folder, pattern in MAPPED.items()
        for path in (ROOT / folder).glob(pattern)
        if path.name != "__init__.py" and "__pycache__" not in path.parts
    }


def test_every_module_is_on_the_map_and_everything_on_it_exists():
    listed = listed_files(map_block((ROOT / "DESIGN.md").read_text()))
    missing = sorted(modules_on_disk() - set(listed))
    gone = sorted(f"{path} (map line {n})" for path, n in listed.items() if not (ROOT / path).exists())
    assert not missing, f"modules missing from DESIGN.md's map (add each with what it holds and its process): {missing}"
    assert not gone, f"DESIGN.md's map lists files that do not exist: {gone}"


def test_the_grammar_reads_shared_folders_and_leaves_out_parentheses():
    lines = [
        "sidecar/          beside one engine",
        "  engines/vllm/layout.py, weights.py   placements   vLLM workers",
        "                            a continued description, naming other.py",
        "  cond.py, _c.c (+ _m.h, _r.h)   the coder",
        "tests/            tests",
        "  support/tiers.py          the tiers",
    ]
    assert listed_files(lines) == {
        "sidecar/engines/vllm/layout.py": 2,
        "sidecar/engines/vllm/weights.py": 2,
        "sidecar/cond.py": 4,
        "sidecar/_c.c": 4,
        "tests/support/tiers.py": 6,
    }
