"""Change detection, the in-engine write and decode on the device that holds the tensors, as ratios to a device copy.

Run: ``python -m tests.benchmarks.bench_device_diff [--mb 256] [--density 0.01] [--reps 5] [--encoding cond]``
(from the repo root, in .venv). On a CUDA machine it measures the GPU; elsewhere the CPU (the same code: torch ops on
CPU tensors, host copies then cost nothing).

One bf16 served tensor of ``--mb`` MB ([rows, 4096]) whose float32 masters live on the device; a step changes
``--density`` of its bf16 elements (their masters moved by one bf16 ulp). Each figure is the median of ``--reps``
runs, timed with ``torch.cuda`` events on CUDA (``perf_counter`` on the CPU), over the median of a device copy of the
served tensor's bytes (``dst.copy_(src)``, one read and one write of the tensor):

* **diff**: the device path of a streamed publish (trainer_client/device_diff.py): the served cast of the masters on
  the device, the comparison with the kept tensor's mirror there, the changed positions and bits copied to the host.
  Printed beside it: the whole call (plus the host part: varint gaps or the ``cond`` coder, the target checksum over
  the host's kept tensor) and today's path for a GPU model (the cast copied to the host and the C kernel; then with
  the encoder and checksums).
* **write**: the in-engine write core (sidecar/engines/write_core.py ``write_verified``) on the device tensor: the
  changed bits written at their positions, then the target checksum of the live tensor (``TpSlice.checksum``: a
  host copy of the tensor and its xxh3-128), as an engine's commit does; printed split into write and verify.
* **decode**: the patch read and its tensor decoded on the host (``read_patch(...).delta``; ``cond`` on its base,
  checked against the target checksum) and the positions and bits copied to the device, as an engine stages it.

The patch is coded in the publisher's row parts (``link.PART_BYTES``), as a streamed publish codes it.

Bit-exactness: the device path's patch bytes, target checksum and changes are compared with the C kernel's on host
copies (bf16, and the ``fp8`` recipe's codes and scales computed on the device against the host recipe); the
script exits 1 on any difference. Last line::

    device_diff: device=<cpu|cuda> diff_over_copy=<x> write_over_copy=<x> decode_over_copy=<x>
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from stitchboard.proto import _bitdiff
from stitchboard.proto.codec import build_patch, checksum, encode_tensor
from stitchboard.proto.decode import read_patch
from stitchboard.sidecar.engines.write_core import TpSlice, write_verified
from stitchboard.trainer_client.device_diff import DeviceDiffer, changed_on_device, flat_bits
from stitchboard.trainer_client.link import PART_BYTES
from stitchboard.trainer_client.recipes import get_recipe
from stitchboard.trainer_client.served_view import cast_served, cast_served_where_it_lives, to_raw

#: Columns of the benchmark tensor (a typical hidden size).
COLS = 4096


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Seconds one call of ``fn`` takes on ``device`` (CUDA events around it; wall clock on the CPU)."""

    def cuda_time(fn: Callable[[], object]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    def cpu_time(fn: Callable[[], object]) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    return cuda_time if device.type == "cuda" else cpu_time


def _median(timer: Callable[[Callable[[], object]], float], fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up (allocator, kernels)
    return statistics.median(timer(fn) for _ in range(reps))


def _step(masters: torch.Tensor, density: float, seed: int) -> torch.Tensor:
    """New masters whose bf16 cast differs from the old one's at about ``density`` of the elements (one ulp)."""
    g = torch.Generator(device=masters.device).manual_seed(seed)
    hit = torch.rand(masters.shape, generator=g, device=masters.device) < density
    moved = (masters.to(torch.bfloat16).view(torch.int16) ^ 1).view(torch.bfloat16).to(torch.float32)
    return torch.where(hit, moved, masters)


def _check_bit_exact(masters: torch.Tensor, new_masters: torch.Tensor, encoding: str) -> bool:
    """The device path's patch, checksum and changes equal the C kernel's on host copies (bf16 and fp8)."""
    ok = True
    kept = cast_served("w", masters.cpu())
    target = cast_served("w", new_masters.cpu())
    got = DeviceDiffer().diff("w", kept, checksum(kept), cast_served_where_it_lives("w", new_masters), encoding)  # type: ignore[arg-type]
    want = encode_tensor("w", kept, target, encoding)  # type: ignore[arg-type]
    ok &= got.encoded == want and got.target_checksum == checksum(target)
    ok &= (got.count, got.gaps, got.new_bits) == _bitdiff.diff(kept.bits, target.bits, 2, False)
    recipe = get_recipe("fp8")
    name = "model.layers.0.mlp.up_proj.weight"
    for m in (masters, new_masters):
        on_dev = recipe.apply_tensor(name, m.to(torch.bfloat16), "BF16")
        on_host = recipe.apply({name: cast_served(name, m.cpu())})
        ok &= all(np.array_equal(to_raw(on_dev[n].cpu().contiguous()).bits, on_host[n].bits) for n in on_host)
    return bool(ok)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="served (bf16) tensor size, MB")
    ap.add_argument("--density", type=float, default=0.01, help="fraction of bf16 elements a step changes")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--encoding", default="cond", choices=["cond", "xor", "overwrite"])
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timer = _timer(device)
    rows = max(1, (args.mb << 20) // (2 * COLS))
    g = torch.Generator().manual_seed(0)
    masters = torch.randn(rows, COLS, generator=g).to(device)
    new_masters = _step(masters, args.density, seed=1)
    served_bytes = rows * COLS * 2
    print(f"device={device.type} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'host'})")
    print(f"tensor: bf16 [{rows}, {COLS}] = {served_bytes / 2**20:.0f} MB; density {args.density}; {args.encoding}")

    src, dst = masters.to(torch.bfloat16), torch.empty(rows, COLS, dtype=torch.bfloat16, device=device)
    copy_s = _median(timer, lambda: dst.copy_(src), args.reps)

    kept = cast_served("w", masters.cpu())
    kept_sum = checksum(kept)
    mirror = flat_bits(masters.to(torch.bfloat16))

    def device_part() -> tuple[np.ndarray, np.ndarray]:
        new = cast_served_where_it_lives("w", new_masters)
        positions, values = changed_on_device(mirror, flat_bits(new))
        return positions.cpu().numpy(), values.cpu().numpy()

    positions, values = device_part()
    count = int(positions.size)
    diff_s = _median(timer, device_part, args.reps)
    differ = DeviceDiffer()
    whole_s = _median(
        timer,
        lambda: differ.diff(
            "w", kept, kept_sum, cast_served_where_it_lives("w", new_masters), args.encoding, PART_BYTES
        ),
        args.reps,
    )

    def host_path() -> object:
        target = cast_served("w", new_masters)
        return encode_tensor("w", kept, target, args.encoding, base_checksum=kept_sum, part_bytes=PART_BYTES)  # type: ignore[arg-type]

    host_s = _median(timer, host_path, args.reps)
    host_detect_s = _median(
        timer, lambda: _bitdiff.diff(kept.bits, cast_served("w", new_masters).bits, 2, False), args.reps
    )

    live = masters.to(torch.bfloat16)
    index = torch.from_numpy(positions).to(device)
    new_bits = torch.from_numpy(values).to(device)
    old_bits = flat_bits(live)[index].clone()
    slot = TpSlice("w", "w", "BF16", (rows, COLS), 0, ((0, rows),), 0, 0)
    target_sum = checksum(cast_served("w", new_masters.cpu()))
    split: dict[str, float] = {}

    states = [(new_bits, target_sum), (old_bits, kept_sum)]  # base -> target, then back: each a verified write
    turns = [0]

    def write_core() -> None:
        bits, want = states[turns[0] % 2]
        turns[0] += 1

        def write(hook: Callable[[str], None]) -> None:
            flat_bits(live)[index] = bits

        timing = write_verified(
            "w", write, [("w", lambda: slot.checksum(live, None), want)], lambda _: None, lambda f, _: f(), None
        )
        split.update(timing)

    write_s = _median(timer, write_core, args.reps)

    target = cast_served("w", new_masters.cpu())
    encoded = encode_tensor("w", kept, target, args.encoding, base_checksum=kept_sum, part_bytes=PART_BYTES)  # type: ignore[arg-type]
    assert encoded is not None
    patch = build_patch([encoded], args.encoding)  # type: ignore[arg-type]

    def decode() -> None:
        delta = read_patch(patch).delta("w", kept, base_verified=True)
        torch.from_numpy(delta.positions).to(device)
        torch.from_numpy(delta.values.view(np.int16)).to(device)

    decode_s = _median(timer, decode, args.reps)
    bit_exact = _check_bit_exact(masters, new_masters, args.encoding)

    ms = 1e3
    print(f"changed elements: {count} ({count / (rows * COLS):.4f}); patch {len(patch)} bytes")
    print(f"device copy of {served_bytes / 2**20:.0f} MB: {copy_s * ms:.2f} ms")
    print(f"diff (cast + compare on {device.type} + changes to host): {diff_s * ms:.2f} ms")
    print(f"  whole DeviceDiffer.diff (+ host gaps/values/checksum, {args.encoding}): {whole_s * ms:.2f} ms")
    print(f"  today's change detection (cast copied to host + C kernel): {host_detect_s * ms:.2f} ms")
    print(f"  today's whole path (+ {args.encoding} encode_tensor and checksums on the host): {host_s * ms:.2f} ms")
    print(
        f"write core: {write_s * ms:.2f} ms (write {split.get('write_s', 0) * ms:.2f} ms, "
        f"verify {split.get('verify_s', 0) * ms:.2f} ms)"
    )
    print(f"decode ({args.encoding}, host) + positions/bits to {device.type}: {decode_s * ms:.2f} ms")
    print(f"bit_exact={str(bit_exact).lower()} (patch, checksum, changes vs the C kernel; fp8 recipe on the device)")
    print(
        f"device_diff: device={device.type} diff_over_copy={diff_s / copy_s:.2f} "
        f"write_over_copy={write_s / copy_s:.2f} decode_over_copy={decode_s / copy_s:.2f}"
    )
    return 0 if bit_exact else 1


if __name__ == "__main__":
    sys.exit(main())
