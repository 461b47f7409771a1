"""The exception tree of the sidecar (service and engine adapter).

Each class carries the HTTP status the sidecar answers with and the wire ``type`` of the JSON
error body (``{"type": ..., "message": ..., <details>}``, see
:class:`stitchboard.proto.schema.ErrorBody`)::

    SidecarError                      500
    ├── WeightVersionError            409  the request's version constraint cannot be met now
    │   ├── WeightVersionNotReadyError     wanted version not applied within the wait
    │   └── WeightVersionPassedError       exact version pinned, engine already past it
    ├── InvalidVersionConstraintError 400  malformed X-Stitch-* header or weight_version field
    ├── RouteForbiddenError           403  engine control / dev route: only the sidecar changes weights
    ├── InvalidPathError              400  a path with dot segments ('.', '..', also percent-encoded)
    ├── BodyTooLargeError             413  a request body over the max_body_bytes setting (or any to a route without
    │                                      one)
    ├── BodyBudgetError               503  no room for a body within body_budget_wait_s (bodies in flight hold
    │                                      body_budget_bytes)
    ├── RoutedExpertsRefusedError     400  return_routed_experts malformed, or not served for this model/route
    ├── NotReadyError                 503  no verified version applied (starting, recovering, unhealthy)
    │   (prime-rl's admin API, STITCH_SIDECAR_ADMIN_API=prime-rl, sidecar/admin_prime_rl.py:)
    ├── InvalidAdminRequestError      422  an admin request the sidecar cannot act on (weight_dir not .../step_N, a
    │                                      pause mode)
    ├── StepNotAppliedError           503  the version of the asked step was not published and applied within
    │                                      admin_update_wait_s
    ├── StepRefusedError              409  the engine refused the version of the asked step for good (a tensor set it
    │                                      has no place for)
    ├── NotAnAdapterRunError          409  prime-rl's LoRA routes on a sidecar whose run is a full-model run
    ├── AdapterNotLoadedError         404  /v1/unload_lora_adapter of a name prime-rl did not load here
    ├── EngineUnavailableError        503  the engine does not answer
    ├── AnswerVersionMismatchError    503  an engine answer names weights the sidecar did not hold (not delivered)
    ├── StagingError                  ---  staged files disagree with their manifests (never sent to the engine)
    ├── NothingPublishedError         ---  the run has no version yet (the sidecar waits)
    ├── EngineVersionMismatchError    ---  after a commit the engine records another version than applied
    ├── EngineChangedError            ---  the engine restarted or its record changed under the sidecar (it boots again)
    │   └── LeaseNotHeldError         ---  the caller does not hold the engine's lease (another sidecar does, or it
    │                                      lapsed)
    ├── PlanRefusedError              ---  the engine refused a plan before any write (the held version keeps serving)
    │   (engine adapter and vLLM worker extension:)
    ├── EngineRequestError            ---  the engine answered a control call with an unexpected status/body
    ├── EngineStateError              ---  the engine's recorded version/phase forbids the call (nothing written)
    ├── UnmappedTensorError           ---  a checkpoint name has no runtime place in the engine (nothing written)
    ├── TpRankError                   ---  another TP rank failed a step this rank passed (all refuse or restore
    │                                      together)
    ├── ApplyRefusedError             ---  apply/snapshot refused before the first write (details: cause)
    ├── AdapterLoadError              ---  a LoRA adapter load/unload refused or unverified; unloaded again, the
    │                                      adapters loaded before keep serving (details: adapter, cause)
    ├── AdapterRunRefusedError        ---  the engine cannot serve the adapter run (no adapter power, too few slots,
    │                                      another base model): /health unhealthy, checked again after a backoff
    └── ApplyFailedError              ---  writing began, then failed (details: cause, restored)
"""

from __future__ import annotations

from stitchboard.proto.errors import StitchError


# --- sidecar service (reconciler, gate, proxy) -------------------------------------------------
class SidecarError(StitchError):
    """Root of sidecar errors."""

    type = "SidecarError"
    status = 500


class WeightVersionError(SidecarError):
    """The request's weight-version constraint cannot be met now; details name the versions."""

    type = "WeightVersionError"
    status = 409


class WeightVersionNotReadyError(WeightVersionError):
    """The wanted version was not applied within the request's wait; retry later or wait longer.

    Details: ``min_version``, ``exact_version``, ``applied_version``, ``target_version``.
    """

    type = "WeightVersionNotReady"


class WeightVersionPassedError(WeightVersionError):
    """The request pins an exact version the engine has already moved past; it will not come back."""

    type = "WeightVersionPassed"


class InvalidVersionConstraintError(SidecarError):
    """An ``X-Stitch-*`` header or the body's ``weight_version`` field is malformed."""

    type = "InvalidVersionConstraint"
    status = 400


class RouteForbiddenError(SidecarError):
    """Engine control and dev routes are refused: only the sidecar changes the engine's weights."""

    type = "RouteForbidden"
    status = 403


class InvalidPathError(SidecarError):
    """The request path has dot segments (``.``, ``..``, percent-encoded or not): refused, never normalised into another
    route."""

    type = "InvalidPath"
    status = 400


class BodyTooLargeError(SidecarError):
    """The request body is larger than the ``max_body_bytes`` setting, or a route that takes no body
    got one (``docs/reference/limits.md``); refused before the body is read further, the
    connection closed. Details: ``limit_bytes``, ``setting``."""

    type = "BodyTooLarge"
    status = 413


class BodyBudgetError(SidecarError):
    """The request bodies in flight hold the whole ``body_budget_bytes`` budget and none gave room for
    this body within ``body_budget_wait_s``; nothing was forwarded. Retry after ``Retry-After``.
    Details: ``budget_bytes``."""

    type = "BodyBudgetExhausted"
    status = 503


class RoutedExpertsRefusedError(SidecarError):
    """A request asks for its routed experts in a way the sidecar cannot serve: a malformed field,
    several outputs, a route without routing, or a model without mixture-of-experts layers
    (details: ``model``)."""

    type = "RoutedExpertsRefused"
    status = 400


class NotReadyError(SidecarError):
    """No verified version is applied (starting, recovering or unhealthy); retry after ``Retry-After``."""

    type = "NotReady"
    status = 503


class InvalidAdminRequestError(SidecarError):
    """An admin request of prime-rl's orchestrator the sidecar cannot act on: a ``weight_dir`` whose
    last folder is not ``step_N`` (nor ``step_N/weight``), a body that is no JSON object, a pause
    mode other than ``keep`` or ``wait``. Retrying the same request cannot help. Details: ``field``,
    ``value`` (what was sent, shortened)."""

    type = "InvalidAdminRequest"
    status = 422


class StepNotAppliedError(SidecarError):
    """``POST /update_weights``: no version of the run records the asked training step (or a later
    one), or its version was not applied and verified, within ``admin_update_wait_s``; a retry can
    succeed (prime-rl retries 5xx). Details: ``step``, ``version`` (the step's version, None: not
    published), ``applied_version``, ``wait_s``."""

    type = "StepNotApplied"
    status = 503


class StepRefusedError(SidecarError):
    """``POST /update_weights``: the engine refused the version of the asked step (or a later one
    with its tensor set) for good: a tensor name, dtype or shape it has no place for
    (:mod:`.refusals`). The held version keeps serving; no retry of the same step can succeed until a
    version with another tensor set is published. Details: ``step``, ``version``, ``refused_version``,
    ``applied_version``, ``cause``."""

    type = "StepRefused"
    status = 409


class NotAnAdapterRunError(SidecarError):
    """A LoRA route of prime-rl's admin API (``/load_lora_adapter``, ``/v1/unload_lora_adapter``) on a sidecar
    whose run is a full-model run (or not yet known to be an adapter run within the wait): its versions are
    waited for with ``/update_weights`` (:mod:`~stitchboard.sidecar.admin_prime_rl_lora`). Details: ``run``,
    ``path``."""

    type = "NotAnAdapterRun"
    status = 409


class AdapterNotLoadedError(SidecarError):
    """``POST /v1/unload_lora_adapter`` names an adapter prime-rl did not load on this sidecar (as vLLM
    answers one, 404). Details: ``adapter``, ``loaded`` (the names loaded)."""

    type = "AdapterNotLoaded"
    status = 404


class EngineUnavailableError(SidecarError):
    """The engine does not answer (down, restarting); retry after ``Retry-After``."""

    type = "EngineUnavailable"
    status = 503


class AnswerVersionMismatchError(SidecarError):
    """An engine answer names a weight version the sidecar did not hold while the request ran (an
    engine restarted or updated behind the sidecar): the answer is not delivered, the claim is
    checked at once; retry after ``Retry-After``."""

    type = "AnswerVersionMismatch"
    status = 503


class StagingError(SidecarError):
    """Staged files disagree with their manifests (tensor set, checksums, encoding, lineage).

    Raised before the engine is touched; the sidecar retries, then takes the anchor route.
    """

    type = "StagingError"


class NothingPublishedError(SidecarError):
    """The run has no version yet, and the engine holds none: the sidecar waits for the first publish."""

    type = "NothingPublished"


class EngineVersionMismatchError(SidecarError):
    """After a commit the engine records another version than the one applied (the sidecar recovers from an anchor)."""

    type = "EngineVersionMismatch"


class EngineChangedError(SidecarError):
    """The engine is no longer the instance, at the version, that the sidecar verified: it
    restarted (new instance id), its record changed or vanished, or it does not answer. The
    sidecar drops its claim at once (no request is admitted or stamped) and boots again, checking
    the engine's weights against the manifest before it claims any version."""

    type = "EngineChanged"


class LeaseNotHeldError(EngineChangedError):
    """The caller does not hold the engine's lease (``docs/reference/engine-lease.md``): another
    owner's lease is live, or the caller's own lapsed. Raised inside the engine for a take refused
    while another owner's lease is live and for a state-changing call without a live lease (nothing
    done), and by the adapter before it calls a state-changing route of the engine without one.
    The sidecar stops claiming a version and tries again to take the lease every renew interval.
    Details: ``holder`` (the owner whose lease is live, or None), ``expires_in_s`` (seconds until
    that lease lapses unless renewed, from the engine's answer; None when no lease is live),
    ``owner`` (the caller).
    """

    type = "LeaseNotHeld"


class PlanRefusedError(SidecarError):
    """The plan could not be staged while the engine served (the engine refused it, or its target
    could not be built); nothing was written and the engine still holds ``held``, which keeps
    serving. A transient refusal is tried again after ``refused_retry_s`` (sooner once a newer
    version is published); a ``permanent`` one (a tensor name, dtype or shape the engine does not
    have) is not: a version with another tensor set is awaited. Details: ``from_version``,
    ``to_version``, ``route``, ``held``, ``cause``, ``permanent``.
    """

    type = "PlanRefused"


# --- engine adapters and the code inside engines (sidecar/engines/) -----------------------------
# Raised by the adapter from the worker's error reports; the worker raises the same classes in
# the engine process (and the codec's PatchError tree for bad patch files and checksums).
class EngineRequestError(SidecarError):
    """The engine answered a control call with an unexpected status or body (not an apply verdict).

    Details: ``path`` (the engine route), ``status`` (HTTP status, when there was one).
    """

    type = "EngineRequestError"


class EngineStateError(SidecarError):
    """The engine's recorded state forbids the call: it holds another version than the call's
    ``from_version``, an earlier apply left it in phase ``failed``, or TP ranks disagree.
    Nothing was written. Details: ``held`` (the engine's version), ``phase``.
    """

    type = "EngineStateError"


class UnmappedTensorError(SidecarError):
    """A checkpoint tensor name has no place in the engine's runtime parameters (unknown name,
    ignored by the model's loader, or a layer kind the adapter cannot address in place).
    Nothing was written. Details: ``name``.
    """

    type = "UnmappedTensor"


class TpRankError(SidecarError):
    """Another tensor-parallel rank of the engine failed a step (reading a file, mapping a name,
    writing) that this rank passed; every rank then refuses, or restores its old bits, together.
    Details: ``failed`` (TP rank -> that rank's error).
    """

    type = "TpRankFailed"


class ApplyRefusedError(SidecarError):
    """An apply or snapshot load was refused before the first write; the engine still holds its
    version, bit for bit. Details: ``cause`` (wire type of the underlying error: ``BaseMismatch``,
    ``PatchFormatError``, ``TensorSetMismatch``, ``UnmappedTensor``, ``EngineStateError``...),
    ``held`` (the engine's version).
    """

    type = "ApplyRefused"


class AdapterLoadError(SidecarError):
    """A LoRA adapter could not be loaded (or unloaded) and verified in the engine
    (:class:`~stitchboard.sidecar.engines.base.ServesAdapters`): the engine refused the folder (a
    rank above its ``max_lora_rank``, a module it does not serve, a bad PEFT config), every slot is
    held, or the tensors it loaded differ from the version's checksums. The adapter was unloaded
    again (nothing of it serves) and the adapters loaded before keep serving. Details: ``adapter``
    (the name), ``cause`` (``EngineRefused``, ``NoFreeSlot``, ``ChecksumMismatch``,
    ``TensorSetMismatch``...), ``name`` (the first PEFT tensor that differs, for a mismatch).
    """

    type = "AdapterLoadFailed"


class AdapterRunRefusedError(SidecarError):
    """The sidecar cannot serve its adapter run (:mod:`~stitchboard.sidecar.adapter_follower`): the
    engine does not serve adapters (SGLang's room: details ``engine``), has fewer adapter slots
    than ``adapter_resident + 1`` (``adapter_slots``, ``needed_slots``), or serves another base model
    (``base_model``, ``run_base_checksum``, ``engine_base_checksum``). Reported on ``/health`` (503
    ``unhealthy``); boot checks again after its backoff. No adapter of the run is loaded."""

    type = "AdapterRunRefused"


class ApplyFailedError(SidecarError):
    """Writing began and then failed (target checksum mismatch, an error while writing).

    Raised inside the engine (with ``cause`` and ``restored``) and again by the adapter from the
    engine's report (adding ``held`` and ``phase``). Details: ``cause`` (wire type of the
    underlying error), ``restored`` (True: the old bits were written back and the engine still
    holds ``held``; False: the engine holds no verified version, ``held`` is None, and it must
    be reloaded from an anchor).
    """

    type = "ApplyFailed"

    @classmethod
    def after_write(cls, what: str, exc: BaseException, *, restored: bool) -> ApplyFailedError:
        """The error for ``exc`` raised while or after ``what`` wrote (``restored``: whether the
        old bits are back); the cause's details (e.g. ``name``) are kept."""
        cause = exc.type if isinstance(exc, StitchError) else type(exc).__name__
        details = exc.details if isinstance(exc, StitchError) else {}
        return cls(f"{what}: {cause}: {exc}", **{**details, "cause": cause, "restored": restored})
