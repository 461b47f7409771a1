"""``Publisher``: the call a trainer adds to its loop to publish its served view as a version.

Per publish: snapshot the served view (bf16 cast by default, see :mod:`.served_view`), diff it
bitwise against the last published view kept in host memory, encode the patch, upload the
files (by sha256; files the bulletin already has are skipped), then commit the manifest. The
commit is the only point where the version comes to exist (DESIGN.md invariant 4).

Versions: the first publish of a run is version 0, an anchor (full snapshot + run assets).
Every later publish is a delta from the previous version; it also carries a snapshot
(an anchor) every ``snapshot_every`` versions, when the tensor set or a dtype/shape changed,
or when asked (``anchor=True``). A retried publish is idempotent: files and manifest are
deterministic, so the same weights give the same version with the same bytes.

Memory: the last published view is kept on the host, one copy (2 bytes per bf16 element:
269 MB for SmolLM2-135M, 16 GB for an 8B model) plus its checksums (~100 bytes per tensor).
Each publish in flight holds one more copy until it is committed (``max_pending`` of them with
``publish_async``). Snapshot shards are written to a temporary folder (``workdir``) and removed
after upload.

Failures: the bulletin client retries transport errors and 5xx answers with exponential
backoff and never retries 4xx; what still fails is raised (``UnavailableError``,
``VersionConflictError``, ``AuthError``...), and the publisher's state stays at the last
committed version. If the commit's answer was lost (``UnavailableError`` at commit), publishing
the same weights again is a no-op success for the same version; publishing newer weights finds
that version taken, checks that it is the lost commit, and carries on after it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from stitchboard.proto.container import RawTensor

from .publisher_core import PublisherCore
from .served_view import served_view
from .version_parts import ViewPart


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
            :meth:`publish_view` publishes the view it is given as it is.
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

    def _take_view(self, model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor]) -> ViewPart:
        view = self.served.apply(served_view(model_or_state_dict, self.dtypes, self.default_dtype))
        return ViewPart(view, frozenset(view))

    def _own_view(self, view: Mapping[str, RawTensor]) -> ViewPart:
        return ViewPart(dict(sorted(view.items())), frozenset(view))
