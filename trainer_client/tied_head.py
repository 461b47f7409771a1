"""Tied embeddings: an output head published beside the input embedding it is tied to is folded
into it (trainer process).

A model whose config says ``tie_word_embeddings`` serves one tensor for both the input embedding
and the output head, and its checkpoint holds the embedding only (``save_pretrained`` drops
``lm_head.weight``): vLLM and SGLang have no place for a separate head and refuse a version that
names it. A live model's tied head shares the embedding's storage and
:func:`~.served_view.checkpoint_state` keeps it once; a *copied* state dict (``{k: v.clone()}``,
an FSDP full state dict, a checkpoint read from disk) holds two tensors. :func:`fold_tied_head`
then drops the head when it is bitwise equal to the embedding, and refuses the view naming both
when it is not (the model is then not tied, whatever its config says: fix the config or the
weights). Nothing is folded when the config says the embeddings are not tied, or when no config
is known (the engine then refuses the head by name; see the sidecar's permanent refusals).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from .errors import TiedWeightsError

T = TypeVar("T")

#: Output head -> the input embeddings it may be tied to, by the checkpoint names of the model
#: families transformers and the engines load (Llama, Qwen, Mistral, Gemma, SmolLM: ``model.``;
#: GPT-2 style: ``transformer.wte``; GPT-NeoX: ``gpt_neox.embed_in``).
TIED_HEADS: dict[str, tuple[str, ...]] = {
    "lm_head.weight": (
        "model.embed_tokens.weight",
        "transformer.wte.weight",
        "model.language_model.embed_tokens.weight",
    ),
    "embed_out.weight": ("gpt_neox.embed_in.weight",),
}


def ties_of_config(config: Mapping[str, Any] | bytes | None) -> bool | None:
    """Whether a model config (``config.json``'s bytes or the parsed object) ties its embeddings:
    its ``tie_word_embeddings`` (or a nested ``text_config``'s); None when it does not say or is not JSON."""
    if isinstance(config, bytes):
        try:
            config = json.loads(config)
        except ValueError:
            return None
    if not isinstance(config, Mapping):
        return None
    for source in (config, config.get("text_config")):
        if isinstance(source, Mapping) and isinstance(source.get("tie_word_embeddings"), bool):
            return bool(source["tie_word_embeddings"])
    return None


def ties_of_module(module: object) -> bool | None:
    """Whether a transformers model ties its embeddings (``model.config.tie_word_embeddings``);
    None for a module without such a config."""
    config = getattr(module, "config", None)
    tied = getattr(config, "tie_word_embeddings", None)
    return tied if isinstance(tied, bool) else None


def fold_tied_head(state: dict[str, T], tied: bool | None, same_bits: Callable[[T, T], bool]) -> dict[str, T]:
    """``state`` without an output head that is tied to an input embedding it also holds.

    Args:
        state: checkpoint name -> tensor (torch tensors or raw views; not modified).
        tied: the config's ``tie_word_embeddings`` (None: unknown; False: untied): only True folds.
        same_bits: whether two tensors have the same dtype, shape and bits.

    Returns:
        ``state`` itself when nothing is folded, else a new dict without the head.

    Raises:
        TiedWeightsError: the config ties the embeddings but the head differs from the embedding
            (dtype, shape or any bit); details ``head`` and ``embedding``.
    """
    if not tied:
        return state
    folded = state
    for head, embeddings in TIED_HEADS.items():
        embedding = next((e for e in embeddings if e in state), None)
        if head not in state or embedding is None:
            continue
        if not same_bits(state[head], state[embedding]):
            raise tied_head_error(head, embedding)
        folded = {n: t for n, t in folded.items() if n != head}
    return folded


def tied_head_error(head: str, embedding: str) -> TiedWeightsError:
    """The refusal of an output head ``head`` that differs from the input embedding ``embedding`` it is tied to."""
    return TiedWeightsError(
        f"the model's config ties its embeddings (tie_word_embeddings) but {head!r} differs from "
        f"{embedding!r}: an engine serves one tensor for both. Publish the model itself or a state dict "
        f"without {head!r} if they are tied, or set tie_word_embeddings to false in config.json if they "
        "are not",
        head=head,
        embedding=embedding,
    )
