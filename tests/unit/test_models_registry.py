import pytest
import torch

import temper.models as models
from temper.models.layers.decoder import INIT_STD
from temper.models.layers.init import depth_scaled_std
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


def test_build_on_cpu_allocates_the_flavor_and_initializes_it() -> None:
    """The debug flavor with vocabulary 300, counted by hand: per block wq and wo 256x256, wk
    and wv 256x128 (4 KV heads of 32), SwiGLU 3 x 256x768 and two norm gains; embedding and
    untied head 300x256; the final norm. Weights follow the family's init: normal(0.02)
    embeddings, 3-std truncated normal projections (0.02, the residual writers depth-scaled),
    unit norm gains."""
    torch.manual_seed(0)
    model = models.build_model("llama3", "debug", device="cpu", vocab_size=300)
    block = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 768 + 2 * 256
    assert sum(p.numel() for p in model.parameters()) == 4 * block + 2 * 300 * 256 + 256
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert torch.equal(model.norm.weight, torch.ones(256))
    assert model.tok_embeddings.weight.std().item() == pytest.approx(INIT_STD, rel=0.03)
    truncated = 0.9866  # the std of a normal cut at 3 std, in units of its std
    attention = model.layers[0].attention
    assert attention.wq.weight.abs().max() <= 3 * INIT_STD
    assert attention.wq.weight.std().item() == pytest.approx(INIT_STD * truncated, rel=0.03)
    out_std = depth_scaled_std(INIT_STD, 4)
    assert out_std < INIT_STD
    assert attention.wo.weight.std().item() == pytest.approx(out_std * truncated, rel=0.03)
