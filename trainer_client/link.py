"""How a delta is cut and coded for the link it travels: the part size and the per-version encoding (trainer process).

**Parts.** The publisher codes every tensor larger than :data:`PART_BYTES` in row parts of about that size
(:func:`stitchboard.proto.codec.encode_tensor`, patch format version 2), so the trainer encodes and each
engine worker decodes a tensor on every core (the engine stages tensor after tensor). Smaller parts cost
bytes (each part's ``cond`` models start afresh): the size is the smallest whose patches stay within 5 % of
one stream per tensor on real SmolLM2 steps (``python -m tests.benchmarks.bench_parts``, figures on
docs/benchmarks.md).

**Encoding.** ``cond`` sends ~2.8x fewer bytes than ``xor`` but decodes slower (it reads the whole base
tensor). With a link of ``link_bytes_per_s``, a version's time to the engine is about
``bytes / link_bytes_per_s + decode_s``; the two break even at

    L* = (bytes_xor - bytes_cond) / (decode_s_cond - decode_s_xor)

which grows with the cores decoding (decode time shrinks) and with the share of elements changed (the byte
saving grows, the decode time stays: ``cond`` reads the touched tensors whole). :func:`choose_encoding` scales
the measured figure :data:`BREAK_EVEN_BYTES_PER_S` (its cores and density beside it) to the decoding cores
and the previous delta's density, and picks ``xor`` above it, ``cond`` below.
"""

from __future__ import annotations

from stitchboard.proto.schema import Encoding

#: Row-part size of the publisher's deltas, bytes: the smallest size within +5 % of one stream per tensor
#: on real SmolLM2-135M steps (bench_parts, 2026-12-05: 2 MiB +2.0 %, 1 MiB +7.6 %; each part's ``cond``
#: models start afresh, ~130 bytes a part).
PART_BYTES = 2 << 20
#: Break-even link speed of ``cond`` against ``xor``, bytes per second, measured by bench_parts on real
#: SmolLM2-135M steps with :data:`BREAK_EVEN_CORES` decoding cores at :data:`BREAK_EVEN_DENSITY` of the
#: elements changed (2026-12-05, docs/benchmarks.md).
BREAK_EVEN_BYTES_PER_S = 1.4e6
#: Decoding cores of that measurement.
BREAK_EVEN_CORES = 2
#: Share of the served view's elements changed per step in that measurement.
BREAK_EVEN_DENSITY = 0.01


def break_even_bytes_per_s(decode_cores: int, density: float | None) -> float:
    """The link speed above which ``xor`` reaches the engine sooner than ``cond``, bytes per second.

    Args:
        decode_cores: cores an engine worker decodes with (>= 1).
        density: share of the view's elements the delta changes (0-1); None: the measured one.
    """
    share = BREAK_EVEN_DENSITY if density is None else density
    return BREAK_EVEN_BYTES_PER_S * (max(1, decode_cores) / BREAK_EVEN_CORES) * (share / BREAK_EVEN_DENSITY)


def choose_encoding(
    link_bytes_per_s: float | None, default: Encoding, decode_cores: int, density: float | None
) -> Encoding:
    """The encoding of the next version's delta.

    Args:
        link_bytes_per_s: the trainer -> engine link, bytes per second; None: always ``default``.
        default: the run's encoding (``cond`` unless set), kept when the link is not given or ``default`` is
            ``overwrite`` (chosen for its idempotence, not its speed).
        decode_cores: cores an engine worker decodes with.
        density: the previous delta's changed share of elements (None: none yet).

    Raises:
        ValueError: ``link_bytes_per_s`` <= 0.
    """
    if link_bytes_per_s is None or default == "overwrite":
        return default
    if link_bytes_per_s <= 0:
        raise ValueError(f"link_bytes_per_s must be > 0, got {link_bytes_per_s}")
    return "xor" if link_bytes_per_s > break_even_bytes_per_s(decode_cores, density) else "cond"
