"""``Publisher``: the call a trainer adds to its loop to publish its served view as a version.

Per publish: snapshot the served view (bf16 cast by default, see :mod:`.served_view`), diff it
bitwise against the last published view kept in host memory, encode the patch, upload the
files (by sha256; files the bulletin already has are skipped), then commit the manifest. The
commit is the only point where the version comes to exist (DESIGN.md invariant 4). A streamed
delta of a model on a GPU is cast and diffed on the GPU, and only the changed positions and bits
come to the host (:mod:`.device_diff`; ``device_kept_view``); CPU tensors use the codec's C kernel.

Versions: the first publish of a run is version 0, an anchor (full snapshot + run assets).
Every later publish is a delta from the previous version; it also carries a snapshot
(an anchor) every ``snapshot_every`` versions, when the tensor set or a dtype/shape changed,
or when asked (``anchor=True``). A retried publish is idempotent: files and manifest are
deterministic, so the same weights give the same version with the same bytes.

Memory: the last published view is kept on the host, one copy (2 bytes per bf16 element:
269 MB for SmolLM2-135M, 16 GB for an 8B model) plus its checksums (~100 bytes per tensor).
:meth:`Publisher.publish` and :meth:`Publisher.stream_view` take a delta tensor by tensor
(:mod:`.stream`; small tensors one per CPU at a time, :mod:`.stream_workers`): the kept view, one new
tensor and the changed positions and bits (~1.5 % of the
view at 1 % changed elements), anchors included (their shards are written one tensor at a time);
after the commit the changes are written into the kept view in place. They take the whole new view
instead (one more copy until it is committed) for version 0, after ``resume="anchor"``, with
squashes (``squash_depths``), with the ``nvfp4`` recipe (fused groups share a scale), and for the
publish right after a lost commit answer. Each ``publish_async`` in flight holds one more whole
copy until it is committed (``max_pending`` of them). Snapshot shards are written to a temporary
folder (``workdir``) and removed after upload.

Failures: the bulletin client retries transport errors and 5xx answers with exponential
backoff and never retries 4xx; what still fails is raised (``UnavailableError``,
``VersionConflictError``, ``AuthError``...), and the publisher's state stays at the last
committed version. If the commit's answer was lost (``UnavailableError`` at commit), publishing
the same weights again is a no-op success for the same version; publishing newer weights finds
that version taken, checks that it is the lost commit, and carries on after it.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stitchboard.proto.container import RawTensor
from stitchboard.proto.dtypes import numel_of
from stitchboard.proto.schema import Encoding

from .device_diff import DeviceDiffer, on_device
from .errors import CheckpointNameError
from .link import PART_BYTES, choose_encoding
from .publisher_core import PublisherCore
from .served_view import (
    TORCH_DTYPE_NAMES,
    cast_served,
    cast_served_where_it_lives,
    checkpoint_name,
    checkpoint_state,
    gather_full,
    served_view,
)
from .stream import StreamedView, ViewStreamer
from .stream_workers import SMALL_BYTES, take_in_parallel
from .tied_head import fold_tied_head, ties_of_config, ties_of_module
from .version_parts import ViewPart

#: Largest ``config.json`` read back from the bulletin to learn whether the run's model ties its embeddings, bytes.
MAX_CONFIG_BYTES = 1 << 20


class Publisher(PublisherCore):
    """Publishes a trainer's served view to a bulletin run, one version per call.

    Args:
        url: bulletin base URL, e.g. ``http://bulletin:8700``.
        run: run id (1-128 of ``[A-Za-z0-9._-]``).
        token: bearer token with the ``publish`` scope (None for an open bulletin).
        encoding: patch encoding, picked per run and recorded in every manifest: ``cond``
            (default; the smallest, ~0.5 bytes per changed element on real RL steps, coded on
            the base's bits, ~2x slower to encode and decode), ``xor`` (the fast choice, ~1.5
            bytes per changed element) or ``overwrite`` (idempotent, largest).
        snapshot_every: a version also carries a snapshot when this many versions passed since
            the last one (>= 1; default 10).
        dtypes: per-tensor served dtype (checkpoint name or fnmatch pattern -> torch dtype);
            fp16/fp32 only: a raw fp8 cast has no scales, no engine loads it, and is refused
            (publish ``served="fp8"``).
        default_dtype: served dtype of the other floating tensors (default bf16).
        served: the served-view recipe (``bf16`` default, ``fp8``, ``fp8-block``, ``nvfp4``;
            :mod:`.recipes`), applied to the bf16 cast of the model at every publish, recorded
            in every manifest (``served``) and in ``config.json`` (``quantization_config``).
            :meth:`publish_view` publishes the view it is given as it is. A model whose config
            ties its embeddings publishes the input embedding only: a separate ``lm_head.weight``
            (a copied state dict) is folded into it when bitwise equal and refused otherwise
            (:mod:`.tied_head`; the model's own config, else the run's ``config.json``).
        assets: the model's non-weight files (a folder, or ``{file name: bytes}``), published
            with version 0 and referenced by every anchor; see :mod:`.assets`.
        resume: for a run that already has versions, ``"rebuild"`` rebuilds the last version
            from the bulletin and verifies it against its manifest (downloads one anchor and
            the deltas after it); ``"anchor"`` skips that and makes the next version an anchor
            whose delta sends every changed tensor whole (``overwrite``).
        max_pending: publishes in flight with :meth:`publish_async` (running + queued, >= 1).
        max_shard_bytes: largest snapshot shard file, bytes (default 2 GiB).
        retries, backoff_s, timeout_s: the bulletin client's retries after a transport error
            or 5xx, first backoff delay (doubling, seconds) and per-request timeout (seconds).
        workdir: folder for temporary snapshot shards, created if missing (default: the system temp folder).
        client: a ready :class:`BulletinClient` to use instead of one built from ``url``/``token``.
        squash_depths: after each commit, also store the squash ``L - d -> L`` for each depth d
            (one patch a replica d or more versions behind fetches instead of d deltas, kept
            only when smaller than that chain; see :mod:`.squash`). Default ``()``: none, since
            each depth costs about two delta encodes per publish; ``(4, 8)`` where replicas
            fall behind.
        pacing: a :class:`~stitchboard.trainer_client.fleet.FleetPacing` (async RL: a publish
            blocks while fewer than the wanted replicas are within ``max_lag`` versions of the
            newest); None: publishes never wait for the fleet. :meth:`wait_for_fleet` waits on demand.
        device_kept_view: for a model on a GPU, whose streamed deltas are cast and diffed there (only the
            changed positions and bits come to the host, :mod:`.device_diff`), also keep a mirror of the kept
            view in GPU memory (one more served view there: 2 bytes per bf16 parameter) so that no whole tensor
            crosses the link; False (default): each kept tensor is copied to the GPU for its diff.
        part_bytes: streamed deltas code tensors larger than this in row parts of about this size, encoded and
            decoded on every core (patch format version 2; default :data:`.link.PART_BYTES`, the smallest within
            +5 % of one stream per tensor); None: one stream per tensor (format version 1). Whole-view encodes
            (the first delta after ``resume="anchor"``, runs with squashes, ``nvfp4``) use the default size.
        link_bytes_per_s: the trainer -> engine link, bytes per second: each version then picks ``cond`` or
            ``xor`` by estimated transfer + decode time (:func:`.link.choose_encoding`, from the break-even
            measured on real steps, scaled to ``decode_cores`` and the last streamed delta's density); None
            (default): every version uses ``encoding``. An ``overwrite`` run stays ``overwrite``.
        decode_cores: cores each engine worker decodes with (for ``link_bytes_per_s``; default 2).

    Publishing, :meth:`publish_async` and the recovery after a lost commit answer are in
    :class:`~stitchboard.trainer_client.publisher_core.PublisherCore`, which
    :class:`~stitchboard.trainer_client.sharded.ShardedPublisher` shares.

    Raises:
        ValueError: ``snapshot_every`` or ``max_pending`` < 1; ``resume`` is neither mode; an unknown
            ``encoding`` or ``served`` recipe; an fp8 ``dtypes`` cast, or ``dtypes`` with a quantized recipe;
            a squash depth < 2.
        SchemaError: bad run id.
        AssetsError: ``assets`` invalid, or differ from the assets the run already carries.
        ResumeError, BulletinError, PatchError: resuming an existing run failed (see
            :func:`~stitchboard.trainer_client.resume.rebuild_version`).
    """

    _applies_recipes = True

    def __init__(
        self,
        *args: Any,
        part_bytes: int | None = PART_BYTES,
        link_bytes_per_s: float | None = None,
        decode_cores: int = 2,
        **kwargs: Any,
    ) -> None:
        if link_bytes_per_s is not None and not link_bytes_per_s > 0:
            raise ValueError(f"link_bytes_per_s must be > 0 bytes per second, got {link_bytes_per_s}")
        if part_bytes is not None and part_bytes < 1:
            raise ValueError(f"part_bytes must be >= 1 (or None: one stream per tensor), got {part_bytes}")
        self.part_bytes = part_bytes
        self.link_bytes_per_s = link_bytes_per_s
        self.decode_cores = decode_cores
        self._density: float | None = None  # changed share of the last streamed delta
        super().__init__(*args, **kwargs)

    @property
    def encoding(self) -> Encoding:
        """The next version's encoding: the run's, or with ``link_bytes_per_s`` :func:`.link.choose_encoding`'s pick."""
        return choose_encoding(self.link_bytes_per_s, self._run_encoding, self.decode_cores, self._density)

    @encoding.setter
    def encoding(self, value: Encoding) -> None:
        self._run_encoding = value

    def _noted(self, view: StreamedView) -> StreamedView:
        """``view``, its changed share of elements kept for the next version's encoding choice."""
        total = sum(numel_of(t.shape) for t in view.layout.values())
        if view.base_version is not None and total:
            self._density = sum(e.entry.count for e in view.encoded) / total
        return view

    @functools.cached_property
    def _tied(self) -> bool | None:
        """The run's ``config.json`` ``tie_word_embeddings`` (the assets given, else the run's
        stored one, read once); None without a config. A model's own config wins (:mod:`.tied_head`)."""
        data = self._asset_data.get("config.json")
        ref = next((a for a in self._assets if a.path == "config.json"), None)
        if data is None and ref is not None and ref.size_bytes <= MAX_CONFIG_BYTES:
            with tempfile.TemporaryDirectory() as folder:
                data = self.client.download_blob(self.run, ref.sha256, Path(folder) / "config.json").read_bytes()
        return ties_of_config(data)

    def _tied_of(self, model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor]) -> bool | None:
        model = getattr(model_or_state_dict, "module", model_or_state_dict)  # DDP holds the model as .module
        tied = ties_of_module(model)
        return self._tied if tied is None else tied

    def _take_view(self, model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor]) -> ViewPart:
        tied = self._tied_of(model_or_state_dict)
        view = self.served.apply(served_view(model_or_state_dict, self.dtypes, self.default_dtype, tied))
        return ViewPart(view, frozenset(view), owned=True)

    def _can_stream(self) -> bool:
        """Whether a delta can be taken tensor by tensor now (see the module docstring for when it cannot)."""
        last = self._published
        return (
            last is not None
            and last.view is not None
            and self._pending is None
            and not self._squasher.depths
            and self.served.per_tensor
        )

    def _stream_of(self, model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor]) -> StreamedView | None:
        if not self._can_stream():
            return None
        state = checkpoint_state(model_or_state_dict, self._tied_of(model_or_state_dict))  # the tied head folded
        return self._streamed(((name, state[name]) for name in sorted(state)), tied=False, stable=True)

    def _served_inputs(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """A stream's inputs by checkpoint name, each name once, a ``DTensor`` gathered (on the calling thread, in
        stream order: a collective)."""
        seen: set[str] = set()
        for raw_name, tensor in named_tensors:
            name = checkpoint_name(raw_name)
            if name in seen:
                raise CheckpointNameError(
                    f"{raw_name!r} and another tensor both map to checkpoint name {name!r}", name=name
                )
            seen.add(name)
            yield name, gather_full(tensor)

    def _served_of(self, name: str, full: torch.Tensor) -> Iterable[tuple[str, RawTensor | torch.Tensor]]:
        """One input's served tensors (cast, then the per-tensor recipe): host copies, or, for a tensor on a device
        other than the CPU (and a recipe that runs there), fresh tensors on that device, which the streamer diffs
        where they live (:mod:`.device_diff`)."""
        if on_device(full) and self.served.on_device:
            cast_t = cast_served_where_it_lives(name, full, self.dtypes, self.default_dtype)
            return self.served.apply_tensor(name, cast_t, TORCH_DTYPE_NAMES[cast_t.dtype]).items()
        return self.served.apply({name: cast_served(name, full, self.dtypes, self.default_dtype)}).items()

    @functools.cached_property
    def _device_differ(self) -> DeviceDiffer:
        """Diffs the served tensors that live on a GPU there; its mirror of the kept view (``device_kept_view``)
        lasts as long as this publisher."""
        return DeviceDiffer(keep_on_device=self.device_kept_view)

    def _streamed(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], tied: bool | None, stable: bool
    ) -> StreamedView:
        """The streamed delta of ``named_tensors`` (``stable``: tensors that keep their memory while the stream
        runs, a model's own, so their casts run on the stream's workers too: :mod:`.stream_workers`)."""
        streamer = ViewStreamer(
            self._published, self.encoding, tied, device=self._device_differ, part_bytes=self.part_bytes
        )
        inputs = self._served_inputs(named_tensors)
        return self._noted(take_in_parallel(streamer, inputs, self._served_of, SMALL_BYTES, cast_on_workers=stable))

    def stream_view(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> StreamedView:
        """The served view of a stream of ``(name, tensor)`` pairs as its delta from the kept view, for
        :meth:`publish_view`: each tensor is cast and given the run's recipe as it arrives, diffed against the
        kept tensor and dropped (:mod:`.stream`); the tied head is folded as :meth:`view_of_stream` does.

        Memory: the kept view plus one tensor (or up to 32 tensors of at most 4 MiB, cast before the worker threads
        take them: :mod:`.stream_workers`) and the changed positions and bits. Where a delta cannot be
        streamed (see the module docstring: version 0, ``resume="anchor"``, squashes, ``nvfp4``), the result
        holds the whole new view (:meth:`view_of_stream`). A publish whose commit answer was lost is settled
        first (its version adopted if the bulletin holds it). Its ``checksums`` are the new view's; publish it
        before any other version, or :meth:`publish_view` refuses it (``PublishError``).

        Args:
            named_tensors: ``(name, tensor)`` pairs, any device and dtype, each name once; a ``DTensor`` is
                gathered (a collective: every rank of its mesh must consume the stream). Consumed once.

        Raises:
            CheckpointNameError: two names map to one checkpoint name.
            TiedWeightsError, ServedViewError: as :meth:`publish`.
            BulletinError: settling a lost commit answer failed.
        """
        self.flush()
        self._resolve_pending()
        if self._can_stream():
            return self._streamed(named_tensors, self._tied, stable=False)  # a generator may reuse a yielded tensor
        return _stream_into(ViewStreamer(None, self.encoding, tied=False), self.view_of_stream(named_tensors).items())

    def stream_raw_view(self, named_raw: Iterable[tuple[str, RawTensor]]) -> StreamedView:
        """:meth:`stream_view` for an already-made served view given one tensor at a time (checkpoint name ->
        :class:`RawTensor`, published as given, like :meth:`publish_view`; the tied head folded): each tensor is
        diffed against the kept one as it arrives, so the caller may make it, hand it over and drop it.

        Memory, fallbacks and errors as :meth:`stream_view` (the run's ``served`` recipe is not applied: the
        tensors are the served view already).
        """
        self.flush()
        self._resolve_pending()
        if self._can_stream():
            streamer = ViewStreamer(self._published, self.encoding, self._tied, owns=False, part_bytes=self.part_bytes)
            return self._noted(_stream_into(streamer, named_raw))
        whole = self._own_view(dict(named_raw)).tensors.items()
        return _stream_into(ViewStreamer(None, self.encoding, tied=False, owns=False), whole)

    def view_of_stream(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, RawTensor]:
        """The served view of a stream of ``(name, tensor)`` pairs, for :meth:`publish_view`: each tensor is cast
        to its served dtype as it arrives (:meth:`publish`'s cast, names stripped of wrapper segments), the tied
        head folded and the run's ``served`` recipe applied, as :meth:`publish` does for a model.

        Memory: the new view (2 bytes per bf16 element) plus the one tensor the stream holds; the stream is
        consumed once. A framework that streams its weights (verl's ``get_per_tensor_param``) never holds a
        second full-precision copy.

        Args:
            named_tensors: ``(name, tensor)`` pairs, any device and dtype, each name once; a ``DTensor`` is
                gathered (a collective: every rank of its mesh must consume the stream).

        Returns:
            Checkpoint name -> :class:`RawTensor`, names sorted.

        Raises:
            CheckpointNameError: two names map to one checkpoint name.
            TiedWeightsError, ServedViewError: as :meth:`publish`.
        """
        view: dict[str, RawTensor] = {}
        for raw_name, tensor in named_tensors:
            name = checkpoint_name(raw_name)
            if name in view:
                raise CheckpointNameError(
                    f"{raw_name!r} and another tensor both map to checkpoint name {name!r}", name=name
                )
            view[name] = cast_served(name, gather_full(tensor), self.dtypes, self.default_dtype)
        return self.served.apply(fold_tied_head(view, self._tied, _same_raw_bits))

    def kept_view(self) -> Mapping[str, RawTensor]:
        """The kept view of the last published version (the base of the next delta; empty when none is kept).

        Read it, never write it: a streamed publish writes the publisher's own tensors of it in place."""
        last = self._published
        return {} if last is None or last.view is None else last.view

    def _own_view(self, view: Mapping[str, RawTensor]) -> ViewPart:
        folded = fold_tied_head(dict(view), self._tied, _same_raw_bits)
        return ViewPart(dict(sorted(folded.items())), frozenset(folded))


def _stream_into(
    streamer: ViewStreamer, named_raw: Iterable[tuple[str, RawTensor]] | Iterable[tuple[str, RawTensor | torch.Tensor]]
) -> StreamedView:
    for name, t in named_raw:
        streamer.add(name, t)
    return streamer.finish()


def _same_raw_bits(a: RawTensor, b: RawTensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and bool(np.array_equal(a.bits, b.bits))
