"""Write the generated tables of ``docs/reference/settings.md`` from the pydantic settings models.

Each model in :data:`MODELS` owns one table on the page, between the lines
``<!-- settings:NAME begin -->`` and ``<!-- settings:NAME end -->``: one row per field, with its
environment variable, type and bounds, default and description, all read from the model. The
rest of the page is written by hand. Run it after changing a setting::

    .venv/bin/python docs/settings_page.py           # rewrite the tables in place
    .venv/bin/python docs/settings_page.py --check   # exit 1 when the page differs (what tests/test_docs.py checks)

Runs in a developer's shell and in the test process (never shipped: mkdocs.yml leaves it out of the site).
"""

from __future__ import annotations

import argparse
import enum
import html
import json
import re
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

from stitchboard.bulletin.settings import BulletinSettings
from stitchboard.sidecar.settings import SidecarSettings
from stitchboard.trainer_client.miles import MilesHookSettings

PAGE = Path(__file__).resolve().parent / "reference" / "settings.md"

#: Table name on the page -> the settings model it is generated from. Every ``BaseSettings`` class
#: of the packages belongs here (tests/test_docs.py checks).
MODELS: dict[str, type[BaseSettings]] = {
    "bulletin": BulletinSettings,
    "sidecar": SidecarSettings,
    "miles": MilesHookSettings,
}

_BOUNDS: tuple[tuple[type, str, str], ...] = (
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.Le, "le", "<="),
)
_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def type_text(annotation: Any) -> str:
    """How a field's type reads in the table: ``int``, ``one of `a`, `b```,
    ``JSON`` (``None`` is left to the default)."""
    origin = get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(f"`{value}`" for value in get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "one of " + ", ".join(f"`{member.value}`" for member in annotation)
    if origin in (Union, types.UnionType):
        return " or ".join(type_text(arg) for arg in get_args(annotation) if arg is not type(None))
    if origin in (dict, list) or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return "JSON"
    return getattr(annotation, "__name__", str(annotation))


def bounds_text(field: FieldInfo) -> str:
    """The field's numeric bounds as code spans (`` `> 0` ``, `` `<= 604800` ``), comma-separated; empty without any."""
    out = []
    for meta in field.metadata:
        for kind, attr, sign in _BOUNDS:
            if isinstance(meta, kind):
                out.append(f"`{sign} {getattr(meta, attr)}`")
    return ", ".join(out)


def value_text(name: str, value: Any) -> str:
    """A default as it is written in the environment: ``true``, ``30``, ``0.5``, bytes with their binary unit."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    if isinstance(value, int) and name.endswith("_bytes"):
        unit = next(((size, label) for size, label in _UNITS if value >= size and value % size == 0), None)
        return f"`{value}`" + (f" ({value // unit[0]} {unit[1]})" if unit else "")
    if isinstance(value, dict | list):
        return f"`{json.dumps(value)}`"
    return f"`{value}`"


def default_text(name: str, field: FieldInfo) -> str:
    """The default column: ``required``, the value, or what a default factory computes (its docstring's first line)."""
    factory: Callable[..., Any] | None = field.default_factory
    if factory is not None:
        if factory in (dict, list):
            return value_text(name, factory())
        doc = (factory.__doc__ or factory.__name__).strip().splitlines()[0]
        return cell(doc.replace("``", "`"))
    if field.default is PydanticUndefined:
        return "required"
    return value_text(name, field.default)


def cell(text: str) -> str:
    """Text safe inside a table cell: no pipes, no raw HTML (``<host name>`` stays visible)."""
    parts = re.split(r"(`[^`]*`)", text)  # code spans keep their characters; only prose is escaped
    return "".join(p if p.startswith("`") else html.escape(p, quote=False) for p in parts).replace("|", "\\|")


def table(model: type[BaseSettings]) -> str:
    """The Markdown table of every field of ``model``: variable, type, default, description."""
    prefix = str(model.model_config.get("env_prefix", ""))
    lines = ["| variable | type | default | description |", "| --- | --- | --- | --- |"]
    own = set(model.__annotations__)  # the model's own fields first, then those it inherits (S3Settings')
    for name, field in sorted(model.model_fields.items(), key=lambda item: item[0] not in own):
        kind = type_text(field.annotation)
        bounds = bounds_text(field)
        lines.append(
            f"| `{(prefix + name).upper()}` | {cell(kind + (', ' + bounds if bounds else ''))} "
            f"| {default_text(name, field)} | {cell(field.description or '')} |"
        )
    return "\n".join(lines)


def render(page: str) -> str:
    """``page`` with every generated table replaced by the one its model gives now.

    Raises:
        ValueError: a model's markers are missing from the page (or appear more than once).
    """
    for name, model in MODELS.items():
        pattern = re.compile(rf"(<!-- settings:{name} begin -->\n).*?(<!-- settings:{name} end -->)", re.DOTALL)
        blocks = list(pattern.finditer(page))
        if len(blocks) != 1:
            raise ValueError(
                f"{PAGE.name}: expected one '<!-- settings:{name} begin/end -->' block for {model.__name__}"
            )
        block = blocks[0]
        page = page[: block.end(1)] + table(model) + "\n" + page[block.start(2) :]
    return page


def main(argv: list[str] | None = None) -> int:
    """Rewrite the page (or, with ``--check``, report whether it is current). Returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs from the models")
    args = parser.parse_args(argv)
    current = PAGE.read_text()
    wanted = render(current)
    if args.check:
        if current != wanted:
            print(f"{PAGE} is out of date: run .venv/bin/python docs/settings_page.py", file=sys.stderr)
            return 1
        return 0
    if current != wanted:
        PAGE.write_text(wanted)
        print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
