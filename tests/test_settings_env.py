"""Environment variables per role: legacy names still read with a warning, new names win,
the settings page's table is complete."""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from stitchboard.bulletin.app import create_app
from stitchboard.bulletin.settings import BulletinSettings, ignored_env_names
from stitchboard.demo.smollm2 import CHECKPOINT_NAME, default_checkpoint_dir
from stitchboard.proto.env import RENAMED_ENV, LegacyEnvWarning, env_setting
from stitchboard.sidecar.engines.vllm.queue_nap import NAP_ENV
from stitchboard.sidecar.settings import SidecarSettings

ROOT = Path(__file__).resolve().parents[1]


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


def test_demo_cache_legacy_name_works_and_the_new_one_wins(monkeypatch, tmp_path):
    monkeypatch.delenv("STITCH_DEMO_CACHE", raising=False)
    monkeypatch.setenv("STITCHBOARD_CACHE", str(tmp_path / "old"))
    with pytest.warns(LegacyEnvWarning, match="STITCH_DEMO_CACHE"):
        assert default_checkpoint_dir() == tmp_path / "old" / "models" / CHECKPOINT_NAME
    monkeypatch.setenv("STITCH_DEMO_CACHE", str(tmp_path / "new"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", LegacyEnvWarning)
        assert default_checkpoint_dir() == tmp_path / "new" / "models" / CHECKPOINT_NAME


def test_bulletin_warns_at_start_up_about_variables_it_ignores(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("STITCH_BULLETIN_URL", "http://bulletin:8700")  # a client's legacy name
    monkeypatch.setenv("STITCH_BULLETIN_STOER", "file:///typo")
    monkeypatch.setenv("STITCH_BULLETIN_KEEP_SNAPSHOTS", "3")  # a real field: no warning
    assert ignored_env_names(
        {
            "STITCH_BULLETIN_URL": "",
            "stitch_bulletin_stoer": "",
            "STITCH_BULLETIN_KEEP_SNAPSHOTS": "",
            "STITCH_SIDECAR_RUN": "",
        }
    ) == ["STITCH_BULLETIN_URL", "stitch_bulletin_stoer"]
    app = create_app(BulletinSettings(store=f"file://{tmp_path}", tokens={"t": {"scopes": ["read"]}}))
    with caplog.at_level(logging.WARNING, logger="stitchboard.bulletin"), TestClient(app):
        pass
    ignored = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ignoring ")]
    assert ignored == [
        "ignoring STITCH_BULLETIN_STOER: no bulletin setting has this name",
        (
            "ignoring STITCH_BULLETIN_URL: it is the legacy name of a client's STITCH_CLIENT_BULLETIN, "
            "not a bulletin setting"
        ),
    ]


def test_settings_page_roles_table_names_every_prefix_variable_and_legacy_name():
    page = (ROOT / "docs" / "reference" / "settings.md").read_text()
    section = page.split("\n## Roles and prefixes\n", 1)[1].split("\n## ", 1)[0]
    rows = [
        [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        for line in section.splitlines()
        if line.startswith("| ")
    ][2:]  # after header and rule
    worker = (ROOT / "sidecar" / "engines" / "contract.py").read_text()  # the engine-side variables
    engine = re.findall(r'^FAULT(?:_VERSION)?_ENV = "([A-Z_]+)"$', worker, re.MULTILINE)
    assert len(engine) == 2
    prefixes = [
        BulletinSettings.model_config["env_prefix"],
        "STITCH_CLIENT_",
        SidecarSettings.model_config["env_prefix"],
        "STITCH_BOOT_",
        "STITCH_ENGINE_",
        NAP_ENV.removesuffix("QUEUE_NAP_S"),  # stitchboard's vLLM plugin, in vLLM's processes
        "STITCH_DEMO_",
    ]
    assert [cells[1] for cells in rows] == [f"`{p}`" for p in prefixes], "one row per role, in this order"
    for name in [*RENAMED_ENV, *RENAMED_ENV.values(), *engine, NAP_ENV]:
        assert f"`{name}`" in section, f"the settings table does not name {name}"
    for new, legacy in RENAMED_ENV.items():
        cells = next(c for c in rows if f"`{new}`" in c[3])
        assert f"`{legacy}`" in cells[4], f"{legacy} is not in the legacy column of {new}'s row"
