import dataclasses
import math

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from temper.models.layers.norm import RMSNorm
from temper.models.layers.rope import RopeScaling, rope_inv_freq
from temper.models.llama3 import FLAVORS, LlamaArgs, Transformer

TINY = LlamaArgs(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=128,
    ffn_hidden_dim=96,
    rope_theta=10000.0,
    # Original context 64 puts the 8 frequencies of head_dim 16 in all three scaling bands.
    rope_scaling=RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    ),
    max_seq_len=256,
)


def _tiny_model(args: LlamaArgs = TINY, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def test_logits_and_hidden_state_shapes() -> None:
    model = _tiny_model()
    ids = torch.randint(0, TINY.vocab_size, (3, 10))
    assert model(ids).shape == (3, 10, TINY.vocab_size)
    hidden = model.hidden_states(ids)
    assert hidden.shape == (3, 10, TINY.dim)
    torch.testing.assert_close(model.output(hidden), model(ids))


def test_causal_future_tokens_do_not_change_earlier_logits() -> None:
    model = _tiny_model()
    ids = torch.randint(0, TINY.vocab_size, (2, 12))
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % TINY.vocab_size
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_position_ids_are_used() -> None:
    model = _tiny_model()
    ids = torch.randint(0, TINY.vocab_size, (2, 9))
    positions = torch.arange(9)[None].expand(2, 9)
    torch.testing.assert_close(model(ids, positions), model(ids))
    assert not torch.allclose(model(ids, positions + 5), model(ids))


def test_init_from_meta_materializes_everything() -> None:
    model = _tiny_model()
    torch.testing.assert_close(
        model.inv_freq, rope_inv_freq(TINY.head_dim, TINY.rope_theta, TINY.rope_scaling)
    )
    assert "inv_freq" not in model.state_dict()
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
    big = _tiny_model(dataclasses.replace(TINY, dim=512, ffn_hidden_dim=1024))
    assert big.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert big.layers[0].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    out_std = 0.02 / math.sqrt(2 * TINY.n_layers)
    assert big.layers[1].feed_forward.w2.weight.std().item() == pytest.approx(out_std, rel=0.05)
    same = _tiny_model()
    for (name, a), b in zip(model.state_dict().items(), same.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_tied_embeddings_survive_to_empty_and_untied_stay_distinct() -> None:
    tied = _tiny_model(dataclasses.replace(TINY, tie_embeddings=True))
    assert tied.output.weight is tied.tok_embeddings.weight
    untied = _tiny_model()
    assert untied.output.weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()
    assert not torch.equal(untied.output.weight, untied.tok_embeddings.weight)


@pytest.mark.parametrize(
    ("flavor", "n_params"),
    [
        ("1b", 1_235_814_400),
        ("3b", 3_212_749_824),
        ("8b", 8_030_261_248),
        ("70b", 70_553_706_496),
        ("405b", 405_853_388_800),
    ],
)
def test_flavor_param_counts_on_meta(flavor: str, n_params: int) -> None:
    with torch.device("meta"):
        model = Transformer(FLAVORS[flavor])
    assert sum(p.numel() for p in model.parameters()) == n_params


def test_debug_flavor_fits_tokenizer_and_size() -> None:
    args = FLAVORS["debug"]
    with torch.device("meta"):
        model = Transformer(args)
    assert args.vocab_size == 2048
    assert 3e6 <= sum(p.numel() for p in model.parameters()) <= 5e6


def test_flops_per_token_by_hand() -> None:
    with torch.device("meta"):
        untied, tied = Transformer(FLAVORS["8b"]), Transformer(FLAVORS["1b"])
    # 8B: input embedding 128256 x 4096 excluded; 32 layers, 32 heads of 128.
    assert untied.flops_per_token(8192) == 6 * (8_030_261_248 - 128256 * 4096) + 12 * 32 * 32 * (
        128 * 8192
    )
    # 1B ties the head to the embedding: the one table counts once, as the head.
    assert tied.flops_per_token(2048) == 6 * 1_235_814_400 + 12 * 16 * 32 * 64 * 2048


def test_args_derive_head_dim_and_reject_bad_heads() -> None:
    assert FLAVORS["3b"].head_dim == 128
    assert (
        LlamaArgs(
            dim=64,
            n_layers=1,
            n_heads=4,
            n_kv_heads=2,
            vocab_size=10,
            ffn_hidden_dim=32,
            head_dim=32,
        ).head_dim
        == 32
    )
    with pytest.raises(ValueError, match="n_kv_heads 3"):
        LlamaArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=3, vocab_size=10, ffn_hidden_dim=32)


def test_rmsnorm_matches_transformers_in_bf16() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 7, 64, dtype=torch.bfloat16) * 3
    weight = torch.rand(64) + 0.5
    ours, theirs = RMSNorm(64, eps=1e-5), LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    ours, theirs = ours.to(torch.bfloat16), theirs.to(torch.bfloat16)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
