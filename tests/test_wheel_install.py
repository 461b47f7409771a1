"""A regular (non-editable) install works: ``pyproject.toml`` lists every package folder, and the wheel
built from this tree, installed into a clean virtual environment, imports every module of every extra.

The editable install of ``.venv`` maps ``stitchboard.<part>`` to the folders with an import hook
that finds any subfolder, so a package missing from ``[tool.setuptools] packages`` goes unseen
there (``stitchboard.trainer_client.recipes`` was). The wheel test builds the wheel from a copy
of the tree (``pip wheel --no-deps --no-build-isolation``: offline, with ``.venv``'s
setuptools), makes a fresh virtual environment without pip, installs the wheel there with
``--no-deps``, and lets that environment see ``.venv``'s third-party packages (torch, vLLM and
every extra's dependencies: too costly to install again) through a ``.pth`` file of plain path
lines, which adds the folder but runs none of its ``.pth`` files, so ``.venv``'s editable hook
stays off and ``stitchboard`` can come only from the wheel. Every module the wheel holds is
imported in that environment (``python -I``, from an empty folder) and must come from it, and
every ``.py`` of the tree's package folders must be in the wheel; so must every CLI subcommand.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

#: Starts processes of its own (docs/testing.md, the slow tier).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
#: ``stitchboard.<part>`` -> its folder in the tree, for the top-level parts.
TOP = {name: ROOT / folder for name, folder in SETUPTOOLS["package-dir"].items() if name.count(".") == 1}

#: Modules that import a framework living in its own environment, not .venv's: in the wheel, but imported there
#: (stitchboard.trainer_client.verl registers verl's checkpoint engine; tests/sidecar/test_verl_vllm.py imports it
#: in .venv-verl).
OWN_ENVIRONMENT = {"stitchboard.trainer_client.verl"}

_IMPORT_ALL = """
import importlib, json, sys
found = {}
for name in json.loads(sys.argv[1]):
    module = importlib.import_module(name)
    found[name] = getattr(module, "__file__", None)
print("MODULES " + json.dumps(found))
"""


def _package_folders() -> dict[str, Path]:
    """Dotted package -> folder, for every folder holding an ``__init__.py`` under a top-level part."""
    out = {}
    for name, folder in TOP.items():
        for init in sorted(folder.rglob("__init__.py")):
            if "__pycache__" not in init.parts:
                out[".".join([name, *init.parent.relative_to(folder).parts])] = init.parent
    return out


def _tree_modules() -> set[str]:
    """Every module of the tree's package folders (``.py`` files), dotted."""
    out = set()
    for package, folder in _package_folders().items():
        for path in folder.glob("*.py"):
            out.add(package if path.stem == "__init__" else f"{package}.{path.stem}")
    return out


def test_pyproject_lists_every_package_folder():
    folders = _package_folders()
    assert sorted(set(folders) - set(SETUPTOOLS["packages"])) == [], "add these to [tool.setuptools] packages"
    assert sorted(set(SETUPTOOLS["packages"]) - set(folders)) == [], "these listed packages have no folder"
    mapped = {name: ROOT / folder for name, folder in SETUPTOOLS["package-dir"].items()}
    assert {name: mapped.get(name) for name in folders} == folders, "map each package to its folder in package-dir"
    # and every top-level folder that is a package (but the tests) is one of stitchboard's parts
    tops = {p.parent for p in ROOT.glob("*/__init__.py")} - {ROOT / "tests"}
    assert tops <= set(TOP.values()), f"top-level packages outside pyproject.toml: {sorted(tops - set(TOP.values()))}"


def _run(*cmd: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def _wheel(tmp_path: Path) -> Path:
    """Build the wheel from a copy of the tree (nothing is written into the tree itself)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for folder in TOP.values():
        shutil.copytree(
            folder, src / folder.relative_to(ROOT), ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
        )
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist", src)
    (wheel,) = (tmp_path / "dist").glob("stitchboard-*.whl")
    return wheel


def _wheel_modules(wheel: Path) -> set[str]:
    """The modules a wheel holds (``.py`` files and compiled extensions), from its RECORD."""
    with zipfile.ZipFile(wheel) as zf:
        (record,) = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
        paths = [line.split(",")[0] for line in zf.read(record).decode().splitlines() if line]
    out = set()
    for path in paths:
        parts = path.split("/")
        if parts[0] != "stitchboard" or not path.endswith((".py", ".so")):
            continue
        stem = parts[-1].split(".")[0]
        out.add(".".join(parts[:-1] if stem == "__init__" else [*parts[:-1], stem]))
    return out


def test_the_wheel_installs_into_a_clean_environment_and_imports_every_module(tmp_path):
    wheel = _wheel(tmp_path)
    in_wheel = _wheel_modules(wheel)
    assert sorted(_tree_modules() - in_wheel) == [], "modules of the tree missing from the wheel"
    assert "stitchboard.trainer_client.recipes.fp8" in in_wheel

    env = tmp_path / "env"
    _run(sys.executable, "-m", "venv", "--without-pip", env)
    python = env / "bin" / "python"
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel)
    site = Path(_run(python, "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip())
    (site / "outer_packages.pth").write_text(sysconfig.get_path("purelib") + "\n")  # third-party packages only

    empty = tmp_path / "cwd"
    empty.mkdir()
    importable = in_wheel - OWN_ENVIRONMENT
    out = _run(python, "-I", "-c", _IMPORT_ALL, json.dumps(sorted(importable)), cwd=empty)
    found = json.loads(out.split("MODULES ", 1)[1])
    outside = {name: file for name, file in found.items() if file is not None and not file.startswith(str(env))}
    assert outside == {}, "modules imported from outside the clean environment"
    assert sorted(found) == sorted(importable) and OWN_ENVIRONMENT <= in_wheel

    # the CLI's subcommands (one entry point per role) load from the wheel too: none is "unavailable"
    cli = _run(env / "bin" / "stitchboard", "--help", cwd=empty)
    commands = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["stitchboard.commands"]
    assert all(name in cli for name in commands) and "unavailable" not in cli, cli
