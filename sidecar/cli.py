"""``stitchboard sidecar run``: serve the sidecar in front of one engine on the same host."""

from __future__ import annotations

import logging
from typing import Annotated, Any

import typer
import uvicorn
from pydantic import ValidationError

from .settings import SidecarSettings

app = typer.Typer(no_args_is_help=True)


@app.callback()
def sidecar() -> None:
    """The sidecar: keeps one rollout engine at the run's latest weights and gates its requests by version."""


def _settings(**overrides: Any) -> SidecarSettings:
    try:
        return SidecarSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        typer.echo(f"invalid sidecar settings: {problems} (options or STITCH_SIDECAR_* env vars)", err=True)
        raise typer.Exit(2) from None


@app.command("run")
def run_sidecar(
    bulletin: Annotated[str | None, typer.Option(help="bulletin URL (env STITCH_SIDECAR_BULLETIN)")] = None,
    run: Annotated[str | None, typer.Option("--run", help="run id to follow (env STITCH_SIDECAR_RUN)")] = None,
    token: Annotated[
        str | None,
        typer.Option(
            help="bearer token with scope replica (reads, and reports this replica to the fleet view; env STITCH_SIDECAR_TOKEN)"
        ),
    ] = None,
    engine: Annotated[str | None, typer.Option(help="engine kind: vllm or sglang (env STITCH_SIDECAR_ENGINE)")] = None,
    engine_url: Annotated[
        str | None,
        typer.Option(
            help="engine base URL on this host (env STITCH_SIDECAR_ENGINE_URL, default http://127.0.0.1:8001)"
        ),
    ] = None,
    host: Annotated[
        str | None, typer.Option(help="address to listen on (env STITCH_SIDECAR_HOST, default 127.0.0.1)")
    ] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (env STITCH_SIDECAR_PORT, default 8000)")] = None,
    boot_version: Annotated[
        int | None,
        typer.Option(
            help="published version the engine's boot checkpoint is; omit to load the nearest anchor (env STITCH_SIDECAR_BOOT_VERSION)"
        ),
    ] = None,
    handoff_dir: Annotated[
        str | None,
        typer.Option(
            help="memory-backed folder shared with the engine (env STITCH_SIDECAR_HANDOFF_DIR, default /dev/shm/stitchboard)"
        ),
    ] = None,
    salt_cache: Annotated[
        bool | None,
        typer.Option(
            "--salt-cache/--reset-cache",
            help="salt the prefix cache by version instead of resetting it at every commit (env STITCH_SIDECAR_SALT_CACHE, default reset)",
        ),
    ] = None,
    replica_id: Annotated[
        str | None,
        typer.Option(
            help="stable id of this replica in the fleet view (env STITCH_SIDECAR_REPLICA_ID, default <host name>-<port>)"
        ),
    ] = None,
    log_level: Annotated[
        str | None, typer.Option(help="log level (env STITCH_SIDECAR_LOG_LEVEL, default info)")
    ] = None,
) -> None:
    """Follow RUN at the bulletin, apply its versions to the engine, and proxy its OpenAI API (other settings: STITCH_SIDECAR_* env vars, see stitchboard.sidecar.settings)."""
    settings = _settings(
        bulletin=bulletin,
        run=run,
        token=token,
        engine=engine,
        engine_url=engine_url,
        host=host,
        port=port,
        boot_version=boot_version,
        handoff_dir=handoff_dir,
        salt_cache=salt_cache,
        replica_id=replica_id,
        log_level=log_level,
    )
    from .app import create_app

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=5,
    )
