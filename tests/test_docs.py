"""The documentation stays true: the README's links resolve, the MkDocs site builds with --strict, the
settings page matches the settings models and names every ``STITCH_*`` variable the code reads, and
every test or module path a page names exists."""

from __future__ import annotations

import importlib.util
import logging
import re
import unicodedata
from pathlib import Path
from types import ModuleType

import pytest
from mkdocs.commands.build import build
from mkdocs.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PACKAGES = ("proto", "bulletin", "trainer_client", "sidecar", "demo")
#: Top-level folders whose paths the pages name (a path under one of these must exist).
TREE_ROOTS = (*PACKAGES, "deploy", "tests", "docs", ".ci")

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`([^`\s]+)`")
_ENV_NAME = re.compile(r"\bSTITCH_[A-Z0-9_]*[A-Z0-9]\b")


def _settings_page() -> ModuleType:
    """``docs/settings_page.py``, the generator (a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("settings_page", DOCS / "settings_page.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def broken_links(markdown: str, base: Path) -> list[str]:
    """The relative links of ``markdown`` (a file in ``base``) whose file, or heading anchor, does not exist."""
    broken = []
    for target in _LINK.findall(markdown):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (base / path).resolve() if path else None
        if file is not None and not file.exists():
            broken.append(f"{target}: no such file")
            continue
        if anchor:
            text = file.read_text() if file is not None else markdown
            headings = {github_anchor(h) for h in re.findall(r"^#+\s+(.+)$", text, re.MULTILINE)}
            if anchor not in headings:
                broken.append(f"{target}: no heading with that anchor")
    return broken


def missing_paths(markdown: str) -> list[str]:
    """The repository paths (and ``path::test`` names) a page names in code spans that do not exist."""
    missing = []
    for span in _CODE_SPAN.findall(markdown):
        path, _, name = span.partition("::")
        if not path.startswith(tuple(f"{r}/" for r in TREE_ROOTS)) or any(c in path for c in "<>{}*|") or "..." in path:
            continue
        file = ROOT / path
        defines = r"^\s*(?:async )?def " + re.escape(name) + r"\("
        if not file.exists() or (name and not re.search(defines, file.read_text(), re.MULTILINE)):
            missing.append(span)
    return missing


def test_every_relative_link_of_the_readme_resolves():
    assert broken_links((ROOT / "README.md").read_text(), ROOT) == []


def test_the_link_check_finds_a_broken_file_and_a_broken_anchor(tmp_path):
    (tmp_path / "page.md").write_text("# A page\n\n## The `settings` table\n")
    text = "[ok](page.md#the-settings-table) [gone](nowhere.md) [bad](page.md#the-table) [web](https://x.org/a)"
    assert broken_links(text, tmp_path) == [
        "nowhere.md: no such file",
        "page.md#the-table: no heading with that anchor",
    ]


def test_the_docs_site_builds_strict(tmp_path):
    """What `make lint` runs: a broken link or anchor, or a page missing from the nav, fails."""
    config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path / "site"))
    assert (
        config["strict"] and config["validation"]["nav"]["omitted_files"] >= logging.WARNING
    )  # --strict: a page left out of nav fails
    build(config)
    assert (tmp_path / "site" / "reference" / "settings" / "index.html").exists()
    # A pipe escaped inside a code span of a table row shows its backslash on the site (GitHub hides it):
    # write it otherwise.
    escaped = [
        f"{page.relative_to(tmp_path / 'site')}: {code}"
        for page in (tmp_path / "site").rglob("*.html")
        for code in re.findall(r"<code>[^<]*\\\|[^<]*</code>", page.read_text())
    ]
    assert escaped == []


def test_the_settings_page_is_generated_from_the_models():
    page = _settings_page()
    current = page.PAGE.read_text()
    assert page.render(current) == current, (
        "docs/reference/settings.md is stale: run .venv/bin/python docs/settings_page.py"
    )


def test_every_settings_model_has_its_table():
    declared = set()
    for package in PACKAGES:
        for file in (ROOT / package).rglob("*.py"):
            declared |= set(re.findall(r"^class (\w+)\([^)]*\bBaseSettings\b", file.read_text(), re.MULTILINE))
    assert declared == {model.__name__ for model in _settings_page().MODELS.values()}


def test_a_settings_table_row_follows_its_field():
    """The generator reads each field: its variable, type, bounds, default and description."""
    page = _settings_page()
    table = page.table(page.MODELS["sidecar"])
    assert "| `STITCH_SIDECAR_BULLETIN` | str | required | Base URL of the bulletin" in table
    row = next(line for line in table.splitlines() if "`STITCH_SIDECAR_MAX_BODY_BYTES`" in line)
    assert "| int, `>= 1` | `67108864` (64 MiB) |" in row


def test_every_stitch_variable_the_code_reads_is_on_the_settings_page():
    files = [f for p in PACKAGES for f in (ROOT / p).rglob("*.py")]
    files += [f for f in (ROOT / "deploy").rglob("*") if f.is_file() and f.suffix in {".py", ".sh", ".yaml", ""}]
    files += [ROOT / "docker-compose.yml"]
    names = {name for f in files for name in _ENV_NAME.findall(f.read_text(errors="replace"))}
    page = (DOCS / "reference" / "settings.md").read_text()
    assert sorted(n for n in names if f"`{n}`" not in page) == []


@pytest.mark.parametrize(
    "page", sorted(p.relative_to(ROOT).as_posix() for p in [ROOT / "README.md", *DOCS.rglob("*.md")])
)
def test_every_path_a_page_names_exists(page):
    assert missing_paths((ROOT / page).read_text()) == []


def test_the_path_check_finds_a_missing_file_and_test():
    text = (
        "`tests/test_docs.py::test_the_docs_site_builds_strict` `tests/nowhere.py` "
        "`tests/test_docs.py::test_gone` `sidecar/engines/<kind>/`"
    )
    assert missing_paths(text) == ["tests/nowhere.py", "tests/test_docs.py::test_gone"]
