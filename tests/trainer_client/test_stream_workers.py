"""A streamed delta taken on worker threads (trainer_client/stream_workers.py): the same view as one tensor at a
time, large tensors on the calling thread, and an error that stops the stream only after every worker stopped."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from stitchboard.proto.codec import checksum
from stitchboard.proto.container import RawTensor
from stitchboard.proto.threads import cpu_threads
from stitchboard.trainer_client.encode_version import BaseTensor
from stitchboard.trainer_client.errors import CheckpointNameError
from stitchboard.trainer_client.served_view import cast_served
from stitchboard.trainer_client.stream import ViewStreamer
from stitchboard.trainer_client.stream_workers import QUEUED, ServedOf, take_in_parallel
from stitchboard.trainer_client.version_parts import PublishedVersion

META = {"run": "r", "version": "1", "base_version": "0"}
#: Inputs over this many bytes are taken on the calling thread.
ALONE = 64 * 64 * 4


def _masters() -> dict[str, torch.Tensor]:
    """Float32 masters: 40 small tensors and two over :data:`ALONE` bytes, in no name order."""
    g = torch.Generator().manual_seed(3)
    out = {f"layers.{i}.weight": torch.randn(64, 16 + i, generator=g) for i in range(40)}
    out["embed.weight"] = torch.randn(256, 64, generator=g)
    out["head.weight"] = torch.randn(128, 64, generator=g)
    return dict(reversed(out.items()))


def _stepped(masters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each master moved by a small update: a few percent of the bf16 bits change."""
    g = torch.Generator().manual_seed(4)
    return {n: t + 3e-3 * torch.randn(t.shape, generator=g) * t.abs() for n, t in masters.items()}


def _base(masters: dict[str, torch.Tensor]) -> PublishedVersion:
    view = {n: cast_served(n, t) for n, t in masters.items()}
    tensors = {n: BaseTensor(t.dtype, tuple(t.shape), checksum(t)) for n, t in view.items()}
    return PublishedVersion(0, view, tensors, 0)


def _cast(name: str, t: torch.Tensor) -> list[tuple[str, RawTensor | torch.Tensor]]:
    return [(name, cast_served(name, t))]


def _failing_after(masters: dict[str, torch.Tensor], count: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The stepped masters' first ``count`` inputs, then a collective that fails to bring the next."""
    for i, (name, t) in enumerate(_stepped(masters).items()):
        if i == count:
            raise RuntimeError("the collective gathering the next tensor failed")
        yield name, t


def _recording(taken: list[str], seconds: float) -> ServedOf:
    """:func:`_cast` after ``seconds``, each name appended to ``taken`` once its cast is made."""

    def served_of(name: str, t: torch.Tensor) -> list[tuple[str, RawTensor | torch.Tensor]]:
        time.sleep(seconds)
        taken.append(name)
        return _cast(name, t)

    return served_of


@pytest.mark.parametrize("encoding", ["cond", "xor"])
def test_the_view_taken_in_parallel_is_the_view_taken_one_tensor_at_a_time(encoding: str) -> None:
    masters = _masters()
    base, new = _base(masters), _stepped(masters)
    one_by_one = ViewStreamer(base, encoding, tied=False, part_bytes=ALONE // 2)  # type: ignore[arg-type]
    for name, t in new.items():
        for served, raw in _cast(name, t):
            one_by_one.add(served, raw)
    expected = one_by_one.finish()
    streamer = ViewStreamer(base, encoding, tied=False, part_bytes=ALONE // 2)  # type: ignore[arg-type]
    got = take_in_parallel(streamer, iter(new.items()), _cast, ALONE)
    assert got.part(META) == expected.part(META)
    assert got.part(META).changed_elements > 0
    assert got.checksums == expected.checksums and got.layout == expected.layout
    assert got.changes == expected.changes


def test_large_tensors_are_taken_on_the_calling_thread_alone_and_small_ones_on_workers() -> None:
    masters = _masters()
    seen: dict[str, tuple[str, int]] = {}
    running = [0]
    lock = threading.Lock()

    def served_of(name: str, t: torch.Tensor) -> list[tuple[str, RawTensor | torch.Tensor]]:
        with lock:
            running[0] += 1
            seen[name] = (threading.current_thread().name, running[0])
        time.sleep(0.002)
        with lock:
            running[0] -= 1
        return _cast(name, t)

    streamer = ViewStreamer(_base(masters), "cond", tied=False)
    take_in_parallel(streamer, iter(_stepped(masters).items()), served_of, ALONE)
    for name in ("embed.weight", "head.weight"):
        assert seen[name] == (threading.current_thread().name, 1), name  # alone: nothing else running
    small = [thread for name, (thread, _) in seen.items() if name.startswith("layers.")]
    assert all(thread.startswith("stitch-stream") for thread in small)
    assert max(n for _, n in seen.values()) <= cpu_threads()


def test_an_error_on_a_worker_is_raised_after_every_worker_stopped() -> None:
    masters = _masters()
    finished: list[str] = []

    def served_of(name: str, t: torch.Tensor) -> list[tuple[str, RawTensor | torch.Tensor]]:
        if name == "layers.30.weight":
            raise ValueError(f"no served form for {name}")
        time.sleep(0.01)
        finished.append(name)
        return _cast(name, t)

    streamer = ViewStreamer(_base(masters), "cond", tied=False)
    with pytest.raises(ValueError, match="layers.30.weight"):
        take_in_parallel(streamer, iter(_stepped(masters).items()), served_of, ALONE)
    settled = list(finished)
    time.sleep(0.05)
    assert finished == settled  # nothing handed over before the raise still runs after it
    assert len(settled) <= 11 + (1 + QUEUED) * cpu_threads()  # the 11 inputs before it, at most a window after it


def test_an_error_reading_the_inputs_stops_the_stream_after_the_workers() -> None:
    """The sixth input fails to arrive (a collective): queued tensors are cancelled, running ones finish first."""
    masters = _masters()
    taken: list[str] = []
    streamer = ViewStreamer(_base(masters), "cond", tied=False)
    with pytest.raises(RuntimeError, match="collective"):
        take_in_parallel(streamer, _failing_after(masters, 5), _recording(taken, 0.01), ALONE)
    settled = list(taken)
    time.sleep(0.05)
    assert taken == settled  # a tensor not started when it failed was cancelled; the running ones had finished
    assert set(list(masters)[:2]) <= set(settled) <= set(list(masters)[:5])  # the large ones were taken in place


def test_a_name_given_twice_by_two_workers_is_refused_by_name() -> None:
    masters = _masters()

    def served_of(name: str, t: torch.Tensor) -> list[tuple[str, RawTensor | torch.Tensor]]:
        return [("shared.bias", cast_served(name, t[0]))] if name.startswith("layers.1") else _cast(name, t)

    streamer = ViewStreamer(_base(masters), "cond", tied=False)
    with pytest.raises(CheckpointNameError, match="shared.bias"):
        take_in_parallel(streamer, iter(_stepped(masters).items()), served_of, ALONE)


def test_a_producer_that_reuses_one_buffer_is_cast_before_its_next_tensor_is_read() -> None:
    """A weight generator that yields every tensor in the same buffer (filled anew for each): with
    ``cast_on_workers=False`` each is cast on the calling thread before the next fill, so the view is the one the
    tensors make one at a time."""
    g = torch.Generator().manual_seed(5)
    masters = {f"layers.{i}.weight": torch.randn(64, 32, generator=g) for i in range(24)}
    base, new = _base(masters), _stepped(masters)
    expected = ViewStreamer(base, "cond", tied=False)
    for name, t in new.items():
        expected.add(name, cast_served(name, t))

    def reusing():
        buf = torch.empty(64, 32)
        for name, t in new.items():
            buf.copy_(t)
            yield name, buf

    def slow_cast(name: str, t: torch.Tensor) -> list[tuple[str, RawTensor | torch.Tensor]]:
        time.sleep(0.002)  # the workers lag behind the producer
        return _cast(name, t)

    streamer = ViewStreamer(base, "cond", tied=False)
    got = take_in_parallel(streamer, reusing(), slow_cast, ALONE, cast_on_workers=False)
    assert got.part(META) == expected.finish().part(META)


def test_tensors_still_queued_when_the_stream_fails_are_never_taken() -> None:
    """Twelve inputs arrive (two large ones first), then the thirteenth fails: the small ones still waiting for a
    worker are cancelled rather than cast, diffed and coded for a stream that is dropped."""
    masters = _masters()
    taken: list[str] = []
    streamer = ViewStreamer(_base(masters), "cond", tied=False)
    with pytest.raises(RuntimeError, match="collective"):
        take_in_parallel(streamer, _failing_after(masters, 12), _recording(taken, 0.05), ALONE)
    assert len(taken) < 12  # some of the ten small ones never ran


def _stream_in_child(queue) -> None:
    masters = _masters()
    streamer = ViewStreamer(_base(masters), "cond", tied=False)
    view = take_in_parallel(streamer, iter(_stepped(masters).items()), _cast, ALONE)
    queue.put(view.part(META).changed_elements)


def test_a_process_forked_after_a_stream_streams_with_a_pool_of_its_own() -> None:
    """The parent's pool threads do not exist in a forked child: its stream starts a new pool instead of queueing
    tensors for threads that never run them."""
    masters = _masters()
    parent = take_in_parallel(
        ViewStreamer(_base(masters), "cond", tied=False), iter(_stepped(masters).items()), _cast, ALONE
    )
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_stream_in_child, args=(queue,))
    child.start()
    try:
        assert queue.get(timeout=60) == parent.part(META).changed_elements
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
