"""The demo's rollout side: engines (vLLM or SGLang) with a sidecar each, and the requests it sends them.

Requests go through the sidecar with a version constraint (``X-Stitch-Min-Version`` for
sampling, ``X-Stitch-Exact-Version`` for the oracle) and come back stamped with
``weight_version_start`` / ``weight_version_end``.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from stitchboard.proto.sidecar_wire import SidecarStatus
from stitchboard.sidecar.client import SidecarClient, stamps, version_headers
from stitchboard.sidecar.engines.launch import engine_nice
from stitchboard.sidecar.engines.vllm.launch import vllm_command, vllm_env

from .errors import DemoError
from .moe_demo import ROUTING_FIELD, RoutingShape
from .processes import ManagedProcess, ProcessGroup, free_port

#: Name the engines serve the model under.
SERVED_NAME = "demo"
#: Engine kinds the demo runs (the sidecar's ``--engine``), and the names its table shows.
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
#: Oracle prompts: greedy completions with logprobs, sent one at a time.
ORACLE_PROMPTS = (
    "The capital of France is",
    "Count from 1 to 5: 1,",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
)


@dataclass
class Rollout:
    """One engine and its sidecar."""

    engine: ManagedProcess
    sidecar: ManagedProcess
    url: str  # the sidecar's base URL: the only one clients use


def stitchboard_cli() -> list[str]:
    """argv prefix running the ``stitchboard`` CLI of this installation."""
    exe = Path(sys.executable).with_name("stitchboard")
    return [str(exe)] if exe.exists() else [shutil.which("stitchboard") or "stitchboard"]


def stub_log(procs: ProcessGroup) -> Path:
    """The file SGLang engines' ``sgl_kernel`` stand-in records its calls in (none may be made)."""
    return procs.log_dir / "sgl_kernel_stub_calls.log"


def stub_calls(procs: ProcessGroup) -> list[str]:
    """The calls the ``sgl_kernel`` stand-in recorded so far (one line each)."""
    path = stub_log(procs)
    return path.read_text(errors="replace").splitlines() if path.exists() else []


def start_engine(
    procs: ProcessGroup, name: str, model_dir: Path, *, kind: str = "vllm", extension: bool = True
) -> tuple[ManagedProcess, str]:
    """Start an engine of ``kind`` (see :data:`ENGINE_NAMES`) on a free loopback port; returns it
    and its URL (not yet healthy). ``extension``: with stitchboard's in-engine code (False: a
    plain engine, for the oracle). On a CPU host it runs niced (:func:`engine_nice`), so its
    sidecar and the bulletin keep their share of the CPU while it generates."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if kind == "sglang":
        from stitchboard.sidecar.engines.sglang.launch import sglang_command, sglang_env

        procs.log_dir.mkdir(parents=True, exist_ok=True)
        return procs.start(
            name,
            sglang_command(model_dir, port, loader=extension, served_model_name=SERVED_NAME),
            f"{url}/health",
            env=sglang_env(stub_log=stub_log(procs)),
            nice=engine_nice(),
        ), url
    argv = vllm_command(model_dir, port, served_model_name=SERVED_NAME, extension=extension)
    return procs.start(name, argv, f"{url}/health", env=vllm_env(), nice=engine_nice()), url


def start_bulletin(procs: ProcessGroup, workdir: Path, on_event: Callable[[str], None]) -> str:
    """Start a bulletin (``stitchboard bulletin serve``) over a new local folder store under ``workdir``, wait up
    to 120 s for its ``/healthz``, and return its URL.

    Raises:
        DemoError: the bulletin exited or did not answer (from :meth:`ManagedProcess.wait_healthy`).
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    store = workdir / f"store-{int(time.time())}"
    bulletin = procs.start(
        "bulletin",
        [*stitchboard_cli(), "bulletin", "serve", "--store", f"file://{store}", "--port", str(port)],
        f"{url}/healthz",
    )
    bulletin.wait_healthy(120)
    on_event(f"bulletin on {url}, store {store}")
    return url


def start_rollout(
    procs: ProcessGroup,
    index: int,
    model_dir: Path,
    bulletin_url: str,
    run: str,
    boot_version: int,
    handoff_dir: Path,
    kind: str = "vllm",
) -> Rollout:
    """Start engine ``index`` of ``kind`` serving ``model_dir`` (= ``boot_version``) and its sidecar."""
    engine, engine_url = start_engine(procs, f"engine-{index}", model_dir, kind=kind)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        *stitchboard_cli(), "sidecar", "run", "--bulletin", bulletin_url, "--run", run, "--engine", kind,
        "--engine-url", engine_url, "--port", str(port), "--boot-version", str(boot_version),
        "--handoff-dir", str(handoff_dir),
    ]  # fmt: skip
    sidecar = procs.start(f"sidecar-{index}", argv, f"{url}/health")
    return Rollout(engine, sidecar, url)


def sample(
    url: str,
    prompt_text: str,
    n: int,
    *,
    min_version: int,
    max_tokens: int,
    seed: int,
    routing: RoutingShape | None = None,
    model: str = SERVED_NAME,
) -> tuple[list[str], tuple[int, int], list[str]]:
    """``n`` sampled completions (temperature 1) of ``prompt_text`` through a sidecar.

    Args:
        routing: a MoE model's routing shape: each completion asks for its routed experts
            (``return_routed_experts``, one output per request: ``n`` concurrent requests, seeds
            ``seed .. seed + n - 1``) and its answer is checked (:meth:`RoutingShape.problem`).
        model: the model asked for (an adapter run's name or ``<run>@<N>``: that run's adapter).

    Returns:
        The completion texts, the (weight_version_start, weight_version_end) the answers spanned
        and, with ``routing``, what each answer lacked of its routing (empty: all complete).

    Raises:
        DemoError: the sidecar answered an error.
    """
    body = {
        "model": model,
        "prompt": prompt_text,
        "n": n,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": seed,
    }
    if routing is None:
        answers = [_complete(url, body, min_version)]
    else:
        bodies = [{**body, "n": 1, "seed": seed + j, ROUTING_FIELD: True} for j in range(n)]
        with ThreadPoolExecutor(max_workers=n) as pool:
            answers = list(pool.map(lambda b: _complete(url, b, min_version), bodies))
    starts, ends = [], []
    for start, end in map(stamps, answers):
        if start is None or end is None:
            raise DemoError(f"sampling through {url}: the answer was stamped with no version ({start}, {end})")
        starts.append(start)
        ends.append(end)
    problems = [p for a in answers if routing is not None and (p := routing.problem(a)) is not None]
    return [c["text"] for a in answers for c in a["choices"]], (min(starts), max(ends)), problems


def _complete(url: str, body: dict, min_version: int) -> dict:
    with SidecarClient(url) as sidecar:
        resp = sidecar.complete(body, min_version=min_version, wait_s=300)
    if resp.status_code != 200:
        raise DemoError(f"sampling through {url} failed: {resp.status_code} {resp.text[:500]}")
    return resp.json()


def greedy(
    url: str,
    *,
    exact_version: int | None = None,
    model: str = SERVED_NAME,
    prompts: tuple[str, ...] = ORACLE_PROMPTS,
    max_tokens: int = 8,
) -> list[dict]:
    """Greedy completions with top-5 logprobs of ``prompts``, one request at a time.

    Sent one at a time because batch composition can change the last bits of a logprob.

    Args:
        url: a sidecar (then pinned with ``exact_version``) or a plain engine (``None``).
        model: the served model name.

    Returns:
        Per prompt ``{"text", "tokens", "token_logprobs", "top_logprobs"}`` as the server sent
        them (floats as parsed from its JSON, so equal answers compare equal).

    Raises:
        DemoError: the server answered an error.
    """
    out = []
    headers = version_headers(exact_version=exact_version, wait_s=300) if exact_version is not None else {}
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 5, "seed": 0}
        resp = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=600)
        if resp.status_code != 200:
            raise DemoError(f"greedy request to {url} failed: {resp.status_code} {resp.text[:500]}")
        choice = resp.json()["choices"][0]
        lp = choice["logprobs"]
        out.append(
            {
                "text": choice["text"],
                "tokens": lp["tokens"],
                "token_logprobs": lp["token_logprobs"],
                "top_logprobs": lp["top_logprobs"],
            }
        )
    return out


def wait_applied(url: str, version: int, timeout_s: float) -> tuple[int, SidecarStatus]:
    """Poll a sidecar's status until it has applied ``version`` (or a later one).

    Returns:
        The applied version and the status that reported it.

    Raises:
        DemoError: the sidecar turned unhealthy or ``timeout_s`` passed.
    """
    deadline = time.monotonic() + timeout_s
    status: SidecarStatus | None = None
    with SidecarClient(url, timeout_s=10) as sidecar:
        while time.monotonic() < deadline:
            status = sidecar.status()
            if status.unhealthy_reason:
                raise DemoError(f"sidecar {url} is unhealthy: {status.unhealthy_reason}")
            if status.applied_version is not None and status.applied_version >= version:
                return status.applied_version, status
            time.sleep(0.2)
    raise DemoError(f"sidecar {url} did not apply version {version} within {timeout_s:.0f} s (status {status})")
