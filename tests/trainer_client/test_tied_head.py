"""A tied-embedding model published from a copied state dict (``lm_head.weight`` a tensor of its
own): the head is folded into the embedding when bitwise equal, refused naming both otherwise."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from stitchboard.bulletin.client import BulletinClient
from stitchboard.trainer_client.errors import TiedWeightsError
from stitchboard.trainer_client.publisher import Publisher
from stitchboard.trainer_client.served_view import served_view
from stitchboard.trainer_client.tied_head import fold_tied_head, ties_of_config


def _tiny_llama(tied: bool) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tied,
    )
    return transformers.LlamaForCausalLM(config)


def _config(tied: bool) -> dict[str, bytes]:
    return {"config.json": json.dumps({"model_type": "llama", "tie_word_embeddings": tied}).encode()}


def _copied(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _published_names(bulletin_url: str, run: str, version: int) -> set[str]:
    with BulletinClient(bulletin_url) as client:
        return {t.name for t in client.manifest(run, version).tensors}


def test_a_copied_state_dict_of_a_tied_model_publishes_the_embedding_only(bulletin, run) -> None:
    model = _tiny_llama(tied=True)
    copied = _copied(model)
    assert (
        "lm_head.weight" in copied
        and copied["lm_head.weight"].data_ptr() != copied["model.embed_tokens.weight"].data_ptr()
    )
    with Publisher(bulletin.url, run, assets=_config(True), backoff_s=0.01) as pub:
        pub.publish(copied)
        pub.publish(model)
    assert _published_names(bulletin.url, run, 0) == _published_names(bulletin.url, run, 1) == set(served_view(model))
    assert "lm_head.weight" not in _published_names(bulletin.url, run, 0)
    with Publisher(bulletin.url, run, backoff_s=0.01) as resumed:  # the config is read back from the run
        resumed.publish(_copied(model))
    assert "lm_head.weight" not in _published_names(bulletin.url, run, 2)


def test_a_head_that_differs_from_its_tied_embedding_is_refused_naming_both(bulletin, run) -> None:
    copied = _copied(_tiny_llama(tied=True))
    copied["lm_head.weight"][0, 0] += 1.0
    with (
        Publisher(bulletin.url, run, assets=_config(True), backoff_s=0.01) as pub,
        pytest.raises(TiedWeightsError) as refused,
    ):
        pub.publish(copied)
    assert refused.value.details == {"head": "lm_head.weight", "embedding": "model.embed_tokens.weight"}
    assert "lm_head.weight" in str(refused.value) and "model.embed_tokens.weight" in str(refused.value)
    with BulletinClient(bulletin.url) as client:
        assert client.latest(run) is None, "nothing published"


def test_an_untied_model_publishes_both(bulletin, run) -> None:
    model = _tiny_llama(tied=False)
    with Publisher(bulletin.url, run, assets=_config(False), backoff_s=0.01) as pub:
        pub.publish(_copied(model))
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= _published_names(bulletin.url, run, 0)


def test_a_view_given_whole_is_folded_too(bulletin, run) -> None:
    view = served_view(_copied(_tiny_llama(tied=True)))
    assert "lm_head.weight" in view
    with Publisher(bulletin.url, run, assets=_config(True), backoff_s=0.01) as pub:
        pub.publish_view(view)
    assert _published_names(bulletin.url, run, 0) == set(view) - {"lm_head.weight"}


@pytest.mark.parametrize(
    ("config", "tied"),
    [
        (b'{"tie_word_embeddings": true}', True),
        (b'{"tie_word_embeddings": false}', False),
        (b'{"text_config": {"tie_word_embeddings": true}}', True),
        (b"{}", None),
        (b"not json", None),
        (None, None),
    ],
)
def test_the_config_says_whether_the_embeddings_are_tied(config: bytes | None, tied: bool | None) -> None:
    assert ties_of_config(config) is tied


def test_only_a_tied_config_folds() -> None:
    state = {"lm_head.weight": 1, "model.embed_tokens.weight": 1, "x": 2}
    assert fold_tied_head(state, None, lambda a, b: a == b) is state
    assert fold_tied_head(state, False, lambda a, b: a == b) is state
    assert fold_tied_head(state, True, lambda a, b: a == b) == {"model.embed_tokens.weight": 1, "x": 2}
