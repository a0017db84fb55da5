import pytest
import torch

import temper.models as models
from temper.models.llama3 import FLAVORS, Transformer


def test_llama3_is_registered() -> None:
    assert "llama3" in models.model_names()
    spec = models.get_model_spec("llama3")
    assert spec.model_cls is Transformer and spec.flavors is FLAVORS


def test_duplicate_and_unknown_names_are_errors() -> None:
    with pytest.raises(ValueError, match="already registered"):
        models.register_model(models.get_model_spec("llama3"))
    with pytest.raises(ValueError, match="'gpt2'.*llama3"):
        models.get_model_spec("gpt2")


def test_unknown_flavor_names_flavor_and_choices() -> None:
    with pytest.raises(ValueError, match=r"'7b'.*'llama3'.*debug, 1b, 3b, 8b, 70b, 405b"):
        models.build_model("llama3", "7b")


def test_build_stays_on_meta_by_default_and_overrides_vocab() -> None:
    model = models.build_model("llama3", "8b", vocab_size=1000)
    assert model.tok_embeddings.weight.is_meta
    assert model.output.weight.shape == (1000, 4096)
    assert FLAVORS["8b"].vocab_size == 128256


def test_build_on_cpu_initializes_weights() -> None:
    torch.manual_seed(0)
    model = models.build_model("llama3", "debug", device="cpu", vocab_size=300)
    assert model.tok_embeddings.weight.device.type == "cpu"
    assert torch.equal(model.norm.weight, torch.ones(256))
    logits = model(torch.randint(0, 300, (1, 16)))
    assert logits.shape == (1, 16, 300) and torch.isfinite(logits).all()
