"""Every error class round-trips through its JSON error body, and wire types name one class each."""

from __future__ import annotations

import importlib
import json
import re

import pytest

import stitchboard.bulletin.errors as bulletin_errors
from stitchboard.bulletin.errors import BulletinError, InvalidRequestError, error_from_body
from stitchboard.proto.errors import StitchError, wire_types
from stitchboard.proto.schema import ErrorBody

for _tree in ("stitchboard.sidecar.errors", "stitchboard.trainer_client.errors"):
    importlib.import_module(_tree)  # their classes join the StitchError tree
#: Every tree (proto, bulletin, sidecar, trainer client), read before any test defines classes.
BY_TYPE = wire_types(StitchError)
EVERY_ERROR = sorted(BY_TYPE.values(), key=lambda cls: cls.type)
BULLETIN_ERRORS = sorted(wire_types(BulletinError).values(), key=lambda cls: cls.type)


def sample(cls: type[StitchError]) -> StitchError:
    return cls(f"{cls.__name__} for run 'r' version 3", run_id="r", version=3, sha256="ab" * 32)


@pytest.mark.parametrize("cls", BULLETIN_ERRORS, ids=lambda cls: cls.__name__)
def test_bulletin_errors_come_back_as_the_same_class(cls: type[BulletinError]) -> None:
    sent = sample(cls)
    assert isinstance(sent, BulletinError)
    again = error_from_body(sent.status, json.loads(json.dumps(sent.body())))
    assert type(again) is cls
    assert (again.type, again.status, again.message, again.details) == (
        cls.type,
        cls.status,
        sent.message,
        sent.details,
    )
    assert again.body() == sent.body()


@pytest.mark.parametrize("cls", EVERY_ERROR, ids=lambda cls: cls.__name__)
def test_every_body_is_an_error_body_naming_its_class(cls: type[StitchError]) -> None:
    body = ErrorBody.model_validate_json(json.dumps(sample(cls).body()))
    assert BY_TYPE[body.type] is cls
    assert body.message == f"{cls.__name__} for run 'r' version 3"
    assert body.model_extra == {"run_id": "r", "version": 3, "sha256": "ab" * 32}


def test_the_bulletin_tree_drawn_in_its_docstring_is_the_tree() -> None:
    drawn = set(re.findall(r"[├└]── (\w+)", bulletin_errors.__doc__ or ""))
    assert drawn | {"BulletinError"} == {cls.__name__ for cls in BULLETIN_ERRORS}


def test_a_schema_error_body_reads_as_bad_input() -> None:
    exc = error_from_body(422, {"type": "SchemaError", "message": "invalid manifest: version: bad"})
    assert isinstance(exc, InvalidRequestError) and exc.type == "SchemaError" and exc.status == 422


def test_two_classes_with_one_wire_type_are_refused() -> None:
    class Root(StitchError):
        type = "Root"

    class First(Root):
        type = "Same"

    class Second(Root):
        type = "Same"

    with pytest.raises(TypeError, match="both have wire type 'Same'"):
        wire_types(Root)
