"""A streamed delta's tensors taken on worker threads, several at a time (trainer process, one rank).

:class:`~.stream.ViewStreamer` takes the new view one tensor at a time: cast to the served dtype, xxh3 checksum,
the codec's diff and encode. Each of these runs in torch or in C with the GIL released, and most tensors of a model
are small (SmolLM2-135M: 272 tensors, 271 under 2 MB served), so a stream taken on the calling thread alone keeps
one core busy (measured on this project's 2-core CI host: 0.48 s of CPU in a 0.44 s publish with torch held to one
thread). :func:`take_in_parallel` casts and takes one tensor per CPU at once on its own threads (a
:class:`~stitchboard.proto.threads.SharedPool` of :func:`~stitchboard.proto.threads.cpu_threads`), while the
calling thread gathers the next inputs (a ``DTensor``'s ``full_tensor()`` is a collective: it stays on the calling
thread, in stream order).

What runs where:
- a tensor of at most ``alone_bytes`` input bytes (the publisher passes :data:`SMALL_BYTES`) is cast and taken on
  a worker, one per CPU at a time, with up to :data:`QUEUED` more inputs handed over per worker so none waits
  for the calling thread (SmolLM2 on 2 cores: stream 0.27 -> 0.22-0.24 s, same process, alternating). Memory: the
  kept view plus one cast per worker; with ``cast_on_workers=False`` up to ``(1 + QUEUED) * cpu_threads()`` casts
  (at most 32 MiB on 2 CPUs, 128 MiB on 8 or more);
- a larger one waits for the running ones and is taken alone on the calling thread, so at most one large tensor is
  held at a time, as before (with the publisher's row parts it is coded on every core,
  :func:`~stitchboard.proto.codec.encode_tensor`; with ``part_bytes=None`` on one);
- a tensor on a GPU is taken on the calling thread too (its diff runs on the device, :mod:`.device_diff`);
- inputs from a producer that may reuse their memory once it yields the next (``cast_on_workers=False``: a
  framework's weight generator given to ``stream_view``) are cast on the calling thread before the next is read,
  and only their diff and encode run on the workers.

The result is the same streamed view, byte for byte, as taking the tensors one by one: the patch lists its tensors
in name order whatever order they were taken in (:func:`~stitchboard.proto.codec.build_patch`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, wait

import torch

from stitchboard.proto.container import RawTensor
from stitchboard.proto.threads import SharedPool, cpu_threads

from .device_diff import on_device
from .stream import StreamedView, ViewStreamer

__all__ = ["QUEUED", "SMALL_BYTES", "take_in_parallel"]

#: Inputs handed to the pool per worker beyond the one it runs: a worker that finishes a tensor starts the next
#: without waiting for the calling thread to get the GIL back.
QUEUED = 3

#: Input bytes up to which the publisher takes a tensor on a worker: twice the default row-part size
#: (:data:`.link.PART_BYTES`), a float32 master of a tensor served in one bf16 part; whatever ``part_bytes`` is.
SMALL_BYTES = 4 << 20

#: The process's stream threads (shared by its publishers; their tasks submit to the part threads, never to these).
_STREAM_THREADS = SharedPool("stitch-stream")


ServedOf = Callable[[str, torch.Tensor], Iterable[tuple[str, RawTensor | torch.Tensor]]]


def take_in_parallel(
    streamer: ViewStreamer,
    inputs: Iterable[tuple[str, torch.Tensor]],
    served_of: ServedOf,
    alone_bytes: int,
    *,
    cast_on_workers: bool = True,
) -> StreamedView:
    """Feed ``streamer`` every served tensor of ``inputs``, several tensors at a time, and finish it.

    Args:
        streamer: a fresh :class:`~.stream.ViewStreamer` (its :meth:`~.stream.ViewStreamer.add` is safe from
            several threads).
        inputs: ``(checkpoint name, tensor)`` pairs, read on the calling thread (any device and dtype; a tensor
            there may be the result of a collective).
        served_of: one input's served tensors (cast, recipe): ``(name, RawTensor or device tensor)`` pairs. Runs
            on a worker thread for a CPU tensor of at most ``alone_bytes``, else on the calling thread.
        alone_bytes: an input tensor larger than this (``numel * element_size``) is taken alone on the calling
            thread.
        cast_on_workers: run ``served_of`` on the workers too; False: on the calling thread, so each input is
            copied (cast) before the next one is read, for a producer that may reuse an input's memory once it
            yields the next (a framework's weight generator); the workers then only diff and encode.

    Returns:
        ``streamer.finish()``.

    Raises:
        Whatever ``inputs``, ``served_of`` or the streamer raise: the first error the calling thread meets (an
        error of ``inputs`` before that of a worker still queued for it), after the tensors not started are
        cancelled and the running ones have stopped; the streamer is then dropped, and the kept view was never
        written.
    """

    def add(served: Iterable[tuple[str, RawTensor | torch.Tensor]]) -> None:
        for served_name, t in served:
            streamer.add(served_name, t)

    def take(name: str, full: torch.Tensor) -> None:
        add(served_of(name, full))

    pool, window = _STREAM_THREADS(), (1 + QUEUED) * cpu_threads()
    running: deque[Future[None]] = deque()
    try:
        for name, full in inputs:
            if on_device(full) or full.numel() * full.element_size() > alone_bytes:
                while running:
                    running.popleft().result()
                take(name, full)
                continue
            while len(running) >= window:
                running.popleft().result()
            if cast_on_workers:
                running.append(pool.submit(take, name, full))
            else:
                running.append(pool.submit(add, list(served_of(name, full))))
        while running:
            running.popleft().result()
    finally:
        for future in running:  # on an error: nothing more starts, and no worker may still write the streamer
            future.cancel()
        wait(running)
    return streamer.finish()
