"""Environment variables per role: legacy names still read with a warning, new names win."""

from __future__ import annotations

import logging
import warnings

import pytest
from fastapi.testclient import TestClient

from stitchboard.bulletin.app import create_app
from stitchboard.bulletin.settings import BulletinSettings, ignored_env_names
from stitchboard.proto.env import LegacyEnvWarning, env_setting


def test_env_setting_reads_a_legacy_name_and_warns_with_the_new_one():
    with pytest.warns(LegacyEnvWarning, match="STITCH_TOKEN is a legacy name.*set STITCH_CLIENT_TOKEN"):
        assert env_setting("STITCH_CLIENT_TOKEN", {"STITCH_TOKEN": "old"}) == "old"
    with pytest.warns(LegacyEnvWarning):  # an empty new name counts as unset
        assert env_setting("STITCH_CLIENT_TOKEN", {"STITCH_CLIENT_TOKEN": "", "STITCH_TOKEN": "old"}) == "old"


def test_env_setting_prefers_the_new_name_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", LegacyEnvWarning)
        assert env_setting("STITCH_CLIENT_TOKEN", {"STITCH_CLIENT_TOKEN": "new", "STITCH_TOKEN": "old"}) == "new"
        assert env_setting("STITCH_CLIENT_TOKEN", {"STITCH_TOKEN": ""}) is None
        assert env_setting("STITCH_CLIENT_TOKEN", {}) is None


def test_bulletin_warns_at_start_up_about_variables_it_ignores(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("STITCH_BULLETIN_URL", "http://bulletin:8700")  # a client's legacy name
    monkeypatch.setenv("STITCH_BULLETIN_STOER", "file:///typo")
    monkeypatch.setenv("STITCH_BULLETIN_KEEP_SNAPSHOTS", "3")  # a real field: no warning
    assert ignored_env_names({"STITCH_BULLETIN_URL": "", "stitch_bulletin_stoer": "", "STITCH_BULLETIN_KEEP_SNAPSHOTS": "", "STITCH_SIDECAR_RUN": ""}) == ["STITCH_BULLETIN_URL", "stitch_bulletin_stoer"]
    app = create_app(BulletinSettings(store=f"file://{tmp_path}", tokens={"t": {"scopes": ["read"]}}))
    with caplog.at_level(logging.WARNING, logger="stitchboard.bulletin"), TestClient(app):
        pass
    ignored = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ignoring ")]
    assert ignored == [
        "ignoring STITCH_BULLETIN_STOER: no bulletin setting has this name",
        "ignoring STITCH_BULLETIN_URL: it is the legacy name of a client's STITCH_CLIENT_BULLETIN, not a bulletin setting",
    ]

