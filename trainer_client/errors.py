"""The exception tree of ``stitchboard.trainer_client``.

Every class derives from :class:`TrainerError`, itself a
:class:`stitchboard.proto.errors.StitchError`, so a caller can catch all trainer-side
failures at once or one kind at a time.
"""

from __future__ import annotations

from stitchboard.proto.errors import StitchError


class TrainerError(StitchError):
    """Root of every error raised on the trainer side."""

    type = "TrainerError"


class ServedViewError(TrainerError):
    """The model's state cannot be turned into a served view (a non-tensor entry, a dtype
    with no safetensors name)."""

    type = "ServedViewError"


class TiedWeightsError(ServedViewError):
    """The model's config ties its input embedding and output head (``tie_word_embeddings``) but
    the view holds both and they differ. ``details["head"]``, ``details["embedding"]``: their names.
    """

    type = "TiedWeightsError"


class ReplicaMismatchError(ServedViewError):
    """A tensor held whole by several ranks (replicated norms, a tied embedding on two pipeline stages)
    has different served bits on them; the shard-local publish refuses the version before any upload.
    ``details["name"]``: the tensor; ``details["ranks"]``: the ranks that hold it.
    """

    type = "ReplicaMismatch"


class CheckpointNameError(ServedViewError):
    """Two different tensors map to one checkpoint name once wrapper prefixes are stripped.

    ``details["name"]`` is the checkpoint name.
    """

    type = "CheckpointNameError"


class PublishError(TrainerError):
    """A publish failed on the trainer side; the run's versions are unchanged by it.

    Bulletin failures are raised as the :mod:`stitchboard.bulletin.errors` tree instead
    (``UnavailableError`` after the retries, ``VersionConflictError``, ``AuthError``...).
    """

    type = "PublishError"


class PublisherClosedError(PublishError):
    """``publish``/``publish_async`` was called on a closed publisher."""

    type = "PublisherClosed"


class AdapterRefusedError(PublishError):
    """A PEFT model (or a pulled version) is not what an adapter run serves (docs/adapters.md): refused before
    anything is uploaded or written. ``details["field"]`` names the field (``use_dora``, ``modules_to_save``,
    ``rank_pattern``, ``r``, ``target_modules``, ``peft_type``, ``adapter``, ...), ``details["value"]`` its value
    (``details["previous"]``: the run's earlier value, for a change between versions).
    """

    type = "AdapterRefused"


class ResumeError(TrainerError):
    """The last published view could not be rebuilt from the bulletin, or the rebuilt view
    does not match its manifest's checksums (``details["tensors"]`` names the mismatches):
    publish a fresh anchor instead (``Publisher(..., resume="anchor")``).

    Or a TRL trainer starts at a step behind the run's last version (``PublishCallback``, resumed from
    an older checkpoint): ``details``: ``run``, ``version``, ``version_step``, ``trainer_step``; resume
    from the checkpoint of ``version_step`` or later, or publish to a new run id.
    """

    type = "ResumeError"


class AssetsError(TrainerError):
    """Run assets are invalid (a non-asset file name, a missing folder) or differ from the
    assets the run already carries: they are published once, with version 0, and immutable."""

    type = "AssetsError"


class FleetTimeoutError(TrainerError):
    """Too few replicas reached a version in time (``wait_for_fleet``, or a publish paced by
    ``FleetPacing``). The message names the replicas that lag and why (state, last error);
    ``details``: ``run_id``, ``version``, ``needed``, ``at_or_above``, ``live``, ``laggards``.
    """

    type = "FleetTimeout"


class CheckpointError(TrainerError):
    """A checkpoint folder the watcher (``stitchboard watch``) cannot publish as it is: a malformed
    or truncated file, or a shard its index lists that is absent. The message names the file;
    ``details["folder"]`` the folder. The watcher logs it and goes on with the next checkpoint."""

    type = "CheckpointError"


class CheckpointRefusedError(CheckpointError):
    """A checkpoint in a form the watcher does not read: pickled weights (``*.bin``), DCP shards
    (``*.distcp``), a PEFT adapter, no weights at all. The message names the file and the
    framework setting that writes a full safetensors checkpoint instead."""

    type = "CheckpointRefused"


class CheckpointGoneError(CheckpointError):
    """The checkpoint folder, or one of its files, was deleted before or while it was read (a
    framework removing old checkpoints); nothing of it was published."""

    type = "CheckpointGone"


class CheckpointChangedError(CheckpointError):
    """A checkpoint's files changed (size, modification time or inode) while they were read: it was
    still being written or was rewritten; nothing of it was published, and it is read again later."""

    type = "CheckpointChanged"


class WatchLayoutError(TrainerError):
    """The watched folder holds checkpoints of another layout than the one asked for, or of several
    layouts (``--layout auto``). The message names the layouts found and their folders."""

    type = "WatchLayout"


class RolloutError(TrainerError):
    """A rollout through the sidecars failed (TRL's ``rollout_func``, :mod:`.trl.rollout`): no sidecar
    could be reached, or one answered with an error. The message names the sidecar and the status;
    ``details``: ``sidecar``, ``status``, ``body`` (the start of the answer)."""

    type = "RolloutError"


class RolloutVersionError(RolloutError):
    """A rollout could not get the weight version it asks for (the version of a training step, or later)
    within its wait: the publish of that step has not committed, or the sidecar did not apply it in time.
    ``details``: ``step`` (the minimum training step), ``min_version``, ``sidecar`` (None when the version
    itself was not found), ``applied_version`` (the sidecar's, when it said). Raise the wait
    (``wait_s``), allow more staleness, or see why the sidecar lags (``/v1/stitch/status``)."""

    type = "RolloutVersion"


class StepConflictError(PublishError):
    """A training step already has a version with other bits (verl's ``send_weights`` retried or restarted with
    other weights for the same ``global_steps``): refused, nothing published. ``details``: ``run``, ``step``,
    ``version`` (the step's version), ``tensors`` (up to 20 that differ). Resume from the checkpoint of that step or
    later, or publish to a new run id."""

    type = "StepConflict"


class StepTimeoutError(TrainerError):
    """No version of a training step was committed within a receiver's wait (verl's ``receive_weights``): the
    trainer's publish failed or is slow. ``details``: ``run``, ``step``, ``latest_version``. Once the version exists,
    a slow fleet raises :class:`FleetTimeoutError` instead, naming the version and the replicas."""

    type = "StepTimeout"


class MilesDeltaError(CheckpointError):
    """A Miles disk-delta version folder (``weight_vNNNNNN/``) refused before any of it was used: its index or a
    shard file missing or malformed, a tensor the index and the shards disagree on, an encoding, compression or
    checksum kind Miles' format does not name, or a tensor the previous view lacks. The message names the file
    and the version; ``details``: ``folder``, ``version``, ``file``. Nothing of the version was published."""

    type = "MilesDelta"


class MilesChecksumError(MilesDeltaError):
    """A tensor of a Miles version decoded to bytes whose checksum is not the one its shard file records (a
    corrupted file, or a delta decoded against another base than Miles diffed it on). ``details`` add
    ``tensor`` and ``checksum_format``. Nothing of the version was published."""

    type = "MilesChecksum"


class MilesBaseVersionError(MilesDeltaError):
    """A Miles version's base version is not the step of the run's latest version on the bulletin (a version
    skipped or published elsewhere), or Miles restarted its version stream (a new baseline) over a run that
    already has later versions: publish each Miles run to its own run id. ``details`` add ``base_version`` and
    ``latest_step``. Nothing was published."""

    type = "MilesBaseVersion"
