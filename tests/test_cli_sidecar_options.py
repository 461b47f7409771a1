"""``stitchboard sidecar run``'s options are the fields of SidecarSettings: name, type, default and help.

An option given on the command line overrides its ``STITCH_SIDECAR_*`` variable; one left out leaves the
variable (else the field's default) in force, even though its shown default is the field's.
"""

from __future__ import annotations

from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from stitchboard.sidecar import app as sidecar_app
from stitchboard.sidecar import cli
from stitchboard.sidecar.settings import SidecarSettings


def run_options() -> dict[str, Any]:
    """Field name -> the click option of ``stitchboard sidecar run``."""
    command = typer.main.get_command(cli.app).commands["run"]  # type: ignore[attr-defined]
    return {p.name: p for p in command.params if p.name != "ctx"}


def test_every_settings_field_is_an_option_with_the_fields_default_and_description():
    options = run_options()
    assert set(options) == set(SidecarSettings.model_fields)
    for name, field in SidecarSettings.model_fields.items():
        option = options[name]
        assert f"--{name.replace('_', '-')}" in option.opts, name
        expected = None if field.is_required() else field.get_default(call_default_factory=True)
        assert option.default == expected, name
        assert field.description is not None and field.description.removesuffix(".") in option.help, name
        assert f"STITCH_SIDECAR_{name.upper()}" in option.help, name
        assert option.is_flag == (field.annotation is bool), name
        assert (
            option.secondary_opts == ([f"--no-{name.replace('_', '-')}"] if option.is_flag else [])
            or name in cli.OFF_SWITCHES
        )
    assert options["salt_cache"].secondary_opts == ["--reset-cache"]  # the published off switch


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[SidecarSettings]:
    """The settings ``run`` starts the app with; nothing is served."""
    seen: list[SidecarSettings] = []

    def create_app(settings: SidecarSettings) -> object:
        seen.append(settings)
        return object()

    monkeypatch.setattr(sidecar_app, "create_app", create_app)
    monkeypatch.setattr(cli.uvicorn, "run", lambda app, **kwargs: None)
    for name in SidecarSettings.model_fields:
        monkeypatch.delenv(f"STITCH_SIDECAR_{name.upper()}", raising=False)
    return seen


def test_options_given_override_the_environment_and_those_left_out_do_not(started, monkeypatch):
    monkeypatch.setenv("STITCH_SIDECAR_BULLETIN", "http://bulletin:8700")
    monkeypatch.setenv("STITCH_SIDECAR_POLL_WAIT_S", "7")
    monkeypatch.setenv("STITCH_SIDECAR_PORT", "8100")
    monkeypatch.setenv("STITCH_SIDECAR_REPORT", "false")
    argv = ["run", "--run", "r1", "--port", "9123", "--engine", "sglang", "--salt-cache", "--refused-retry-s", "2.5"]
    result = CliRunner().invoke(cli.app, argv)
    assert result.exit_code == 0, result.output
    (settings,) = started
    assert (settings.bulletin, settings.run, settings.port, settings.engine) == (
        "http://bulletin:8700",
        "r1",
        9123,
        "sglang",
    )
    assert settings.salt_cache is True and settings.refused_retry_s == 2.5
    assert settings.poll_wait_s == 7 and settings.report is False  # from the environment, not the options' defaults
    assert settings.max_backoff_s == SidecarSettings.model_fields["max_backoff_s"].default


def test_a_flag_turns_off_what_the_environment_turned_on(started, monkeypatch):
    monkeypatch.setenv("STITCH_SIDECAR_SALT_CACHE", "true")
    monkeypatch.setenv("STITCH_SIDECAR_STAGE_ANCHOR_ROUTES", "true")
    argv = ["run", "--bulletin", "http://b", "--run", "r1", "--reset-cache", "--no-stage-anchor-routes", "--no-report"]
    result = CliRunner().invoke(cli.app, argv)
    assert result.exit_code == 0, result.output
    (settings,) = started
    assert (settings.salt_cache, settings.stage_anchor_routes, settings.report) == (False, False, False)


def test_a_value_the_settings_refuse_exits_2_naming_the_field(started):
    result = CliRunner().invoke(cli.app, ["run", "--bulletin", "http://b", "--run", "r1", "--lease-ttl-s", "0"])
    assert result.exit_code == 2 and "lease_ttl_s" in result.output and not started


@pytest.mark.parametrize(("option", "value"), [("--port", "80x"), ("--poll-wait-s", "soon"), ("--engine", "tgi")])
def test_an_option_is_parsed_as_its_fields_type(started, option, value):
    result = CliRunner().invoke(cli.app, ["run", "--bulletin", "http://b", "--run", "r1", option, value])
    assert result.exit_code == 2 and f"Invalid value for '{option}'" in result.output, result.output
    assert "invalid sidecar settings" not in result.output and not started  # refused by the option, before the settings
