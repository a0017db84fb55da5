"""DeepSeek V4's layers, each against the matching transformers module on the same random
weights and inputs: forward outputs and every gradient, in fp32.

The tiny config compresses CSA windows of 4 and HCA windows of 8 over 24 tokens, and keeps 3
compressed entries per query, so the windows, the overlap and the top-k choice all matter.
"""

from __future__ import annotations

import pytest
import torch
from hf_parity import earliest_first_topk, max_rel_err
from torch import nn
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from temper.models.layers.compressor import CompressedIndexer, Compressor, Windows, rope_tail
from temper.models.layers.grouped_linear import GroupedLinear
from temper.models.layers.hyper_connections import HyperConnection, HyperHead, residual
from temper.models.layers.rope import YarnScaling, rope_cos_sin, rope_inv_freq
from temper.models.layers.routers import GroupLimitedRouter, GroupLimitedRouting, HashRouter


@pytest.fixture(autouse=True)
def _ties_decided_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers selects with ``topk``, whose order among equal scores is unspecified:
    here it decides ties as ``select_top_k`` does (``earliest_first_topk``)."""
    monkeypatch.setattr(torch.Tensor, "topk", earliest_first_topk)


SEQ = 24
CONFIG = DeepseekV4Config(
    vocab_size=64,
    hidden_size=32,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    head_dim=16,
    partial_rotary_factor=0.5,  # 8 rotary dims
    q_lora_rank=12,
    n_routed_experts=6,
    num_experts_per_tok=2,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    hc_mult=3,
    hc_sinkhorn_iters=5,
    sliding_window=8,
    o_groups=2,
    o_lora_rank=8,
    index_n_heads=2,
    index_head_dim=12,
    index_topk=3,
    rms_norm_eps=1e-5,
    max_position_embeddings=64,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
)
ROPE_DIM = 8


def _randomized(module: nn.Module) -> nn.Module:
    """transformers leaves these modules' parameters uninitialized: fill them, seeded."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name or "scale" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.3)
    return module


def _load(ours: nn.Module, hf_module: nn.Module, names: dict[str, str]) -> dict[str, str]:
    """Copy hf_module's parameters into ours under ``names`` (ours -> HF); every parameter of
    ours must be named. Returns the names."""
    hf_params = dict(hf_module.named_parameters())
    with torch.no_grad():
        for name, param in ours.named_parameters():
            param.copy_(hf_params[names[name]])
    return names


def _check_grads(ours: nn.Module, hf_module: nn.Module, names: dict[str, str]) -> None:
    hf_params = dict(hf_module.named_parameters())
    for name, param in ours.named_parameters():
        expected = hf_params[names[name]].grad
        if expected is None:
            assert param.grad is None, f"{name} has a gradient; transformers' has none"
            continue
        assert max_rel_err(param.grad, expected) < 1e-5, name


def _compress_rope() -> tuple[torch.Tensor, torch.Tensor]:
    """Temper's cos/sin of the compressed layers' rotary at positions 0..SEQ-1: YaRN with
    attention factor 1, as transformers builds V4's ``compress`` rotary."""
    yarn = YarnScaling(factor=4.0, original_max_position_embeddings=16, attention_factor=1.0)
    inv_freq = rope_inv_freq(ROPE_DIM, CONFIG.compress_rope_theta, yarn)
    hf_inv_freq = hf.DeepseekV4RotaryEmbedding(CONFIG).compress_inv_freq
    torch.testing.assert_close(inv_freq, hf_inv_freq, rtol=0, atol=0)
    return rope_cos_sin(inv_freq, torch.arange(SEQ)[None])


def _inputs(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1), requires_grad=True)


def test_rope_tail_is_v4_interleaved_rotary() -> None:
    cos, sin = _compress_rope()
    x = _inputs(1, SEQ, 2, 16)
    hf_cos, hf_sin = hf.DeepseekV4RotaryEmbedding(CONFIG)(x, torch.arange(SEQ)[None], "compress")
    expected = hf.apply_rotary_pos_emb(x.transpose(1, 2), hf_cos, hf_sin).transpose(1, 2)
    torch.testing.assert_close(rope_tail(x, cos, sin), expected, rtol=1e-6, atol=1e-6)


def test_hyper_connection_matches_transformers() -> None:
    theirs = _randomized(hf.DeepseekV4HyperConnection(CONFIG))
    ours = HyperConnection(32, 3, sinkhorn_iters=5, eps=CONFIG.hc_eps, norm_eps=1e-5)
    names = _load(ours, theirs, {"fn": "fn", "base": "base", "scale": "scale"})
    hf_streams, out = _inputs(2, SEQ, 3, 32), _inputs(2, SEQ, 32)
    streams = hf_streams.detach().clone().requires_grad_()
    hf_post, hf_comb, hf_in = theirs(hf_streams)
    # transformers' decoder layer: post * out + comb^T @ streams.
    expected = hf_post.unsqueeze(-1) * out.unsqueeze(-2) + hf_comb.transpose(-1, -2) @ hf_streams
    block_input, post, comb = ours(streams)
    got = residual(streams, out, post, comb)
    assert max_rel_err(block_input, hf_in) < 1e-6
    assert max_rel_err(got, expected) < 1e-6
    # Sinkhorn leaves comb (nearly) doubly stochastic.
    torch.testing.assert_close(comb.sum(-2), torch.ones(2, SEQ, 3), atol=1e-4, rtol=0)
    probe, probe_in = torch.randn_like(expected), torch.randn_like(hf_in)
    ((expected * probe).sum() + (hf_in * probe_in).sum()).backward()
    ((got * probe).sum() + (block_input * probe_in).sum()).backward()
    assert max_rel_err(streams.grad, hf_streams.grad) < 1e-5
    _check_grads(ours, theirs, names)


def test_hyper_head_matches_transformers() -> None:
    theirs = _randomized(hf.DeepseekV4HyperHead(CONFIG))
    ours = HyperHead(32, 3, eps=CONFIG.hc_eps, norm_eps=1e-5)
    names = _load(ours, theirs, {"fn": "hc_fn", "base": "hc_base", "scale": "hc_scale"})
    streams = _inputs(2, SEQ, 3, 32)
    expected, got = theirs(streams), ours(streams)
    assert max_rel_err(got, expected) < 1e-6
    probe = torch.randn_like(expected)
    (expected * probe).sum().backward()
    (got * probe).sum().backward()
    _check_grads(ours, theirs, names)


def test_grouped_linear_matches_transformers() -> None:
    theirs = _randomized(hf.DeepseekV4GroupedLinear(32, 16, 2))
    ours = GroupedLinear(32, 16, 2)
    names = _load(ours, theirs, {"weight": "weight"})
    x = _inputs(2, SEQ, 2, 32)
    expected, got = theirs(x), ours(x)
    assert got.shape == (2, SEQ, 2, 8)
    assert max_rel_err(got, expected) < 1e-6
    probe = torch.randn_like(expected)
    (expected * probe).sum().backward()
    (got * probe).sum().backward()
    _check_grads(ours, theirs, names)


def _sorted_routes(weights: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Routes in expert order: transformers' top-k leaves them unsorted."""
    order = experts.argsort(dim=-1)
    return weights.gather(1, order), experts.gather(1, order)


@pytest.mark.parametrize("kind", ["top_k", "hash"])
def test_routers_match_transformers(kind: str) -> None:
    x = _inputs(2 * SEQ, 32)
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(2))
    if kind == "hash":
        theirs = _randomized(hf.DeepseekV4HashRouter(CONFIG))
        theirs.tid2eid.copy_(torch.rand(64, 6, generator=torch.Generator()).argsort(-1)[:, :2])
        ours = HashRouter(32, 6, 2, 64, CONFIG.routed_scaling_factor)
        ours.tid2eid.copy_(theirs.tid2eid)
        by_token = (None, ids.flatten())
        _, hf_weights, hf_experts = theirs(x, ids)
    else:
        theirs = _randomized(hf.DeepseekV4TopKRouter(CONFIG))
        theirs.e_score_correction_bias.uniform_(-0.3, 0.3)
        routing = GroupLimitedRouting(1, 1, CONFIG.routed_scaling_factor, "sqrtsoftplus")
        ours = GroupLimitedRouter(32, 6, 2, True, routing).eval()
        ours.expert_bias.copy_(theirs.e_score_correction_bias)
        _, hf_weights, hf_experts = theirs(x)
        by_token = ()
    names = _load(ours, theirs, {"gate.weight": "weight"})
    probs, weights, experts = ours(x, *by_token)
    hf_weights, hf_experts = _sorted_routes(hf_weights, hf_experts)
    weights, experts = _sorted_routes(weights, experts)
    assert torch.equal(experts, hf_experts)
    assert max_rel_err(weights, hf_weights) < 1e-6
    torch.testing.assert_close(probs.sum(-1), torch.ones(2 * SEQ))
    probe = torch.randn_like(weights)
    (hf_weights * probe).sum().backward()
    (weights * probe).sum().backward()
    _check_grads(ours, theirs, names)


def test_hca_compressor_matches_transformers() -> None:
    theirs = _randomized(hf.DeepseekV4HCACompressor(CONFIG))
    ours = Compressor(32, 16, 8, overlap=False, norm_eps=1e-5)
    same = ("kv_proj.weight", "gate_proj.weight", "position_bias", "kv_norm.weight")
    names = _load(ours, theirs, {n: n for n in same})
    x = _inputs(2, SEQ + 5, 32)  # 3 complete windows and a partial one
    positions = torch.arange(SEQ + 5)[None].expand(2, -1)
    hf_entries, bias = theirs(x, None, positions, None, 0)
    cos, sin = rope_cos_sin(
        rope_inv_freq(
            ROPE_DIM,
            CONFIG.compress_rope_theta,
            YarnScaling(factor=4.0, original_max_position_embeddings=16, attention_factor=1.0),
        ),
        positions,
    )
    windows = Windows.of(positions, torch.zeros_like(positions), 8)
    entries = ours(x, cos, sin, windows)
    assert entries.shape == (2, 3, 16)
    assert max_rel_err(entries, hf_entries[:, 0]) < 1e-6
    assert torch.equal(windows.visible(), bias[:, 0] == 0)
    probe = torch.randn_like(entries)
    (hf_entries[:, 0] * probe).sum().backward()
    (entries * probe).sum().backward()
    _check_grads(ours, theirs, names)


def test_packed_documents_compress_apart() -> None:
    """A row packing documents of 11 and 13 tokens: each document's windows start at its own
    first token (a partial window at a document's end is dropped, not joined to the next
    document's tokens), and its queries see only its own entries."""
    positions = torch.cat((torch.arange(11), torch.arange(13)))[None]
    doc_ids = torch.cat((torch.zeros(11), torch.ones(13))).long()[None]
    windows = Windows.of(positions, doc_ids, 4)
    # 5 windows in 24 // 4 = 6 slots; the last is not valid.
    assert windows.starts.tolist() == [[0, 4, 11, 15, 19, 0]]
    assert windows.valid.tolist() == [[True] * 5 + [False]]
    assert windows.has_previous.tolist() == [[False, True, False, True, True, False]]
    # The query at token 14 (position 3 of document 1) sees its first window only.
    assert windows.visible()[0, 14].tolist() == [False, False, True, False, False, False]
    assert windows.visible()[0, 10].tolist() == [True, True, False, False, False, False]
    # Rows shorter than a window: no entries, none seen.
    short = Windows.of(positions[:, :3], doc_ids[:, :3], 4)
    compressor = Compressor(8, 4, 4, overlap=True, norm_eps=1e-5)
    cos, sin = rope_cos_sin(rope_inv_freq(2, 10000.0), positions[:, :3])
    entries = compressor(torch.randn(1, 3, 8), cos, sin, short)
    assert entries.shape == (1, 0, 4) and short.visible().shape == (1, 3, 0)


def test_csa_compressor_and_indexer_match_transformers() -> None:
    theirs = _randomized(hf.DeepseekV4CSACompressor(CONFIG))
    compressor = Compressor(32, 16, 4, overlap=True, norm_eps=1e-5)
    indexer = CompressedIndexer(32, 12, 2, 12, 4, 3, norm_eps=1e-5)
    ours = nn.ModuleDict({"compressor": compressor, "indexer": indexer})
    part = ("kv_proj.weight", "gate_proj.weight", "position_bias", "kv_norm.weight")
    names = {f"compressor.{n}": n for n in part}
    names |= {f"indexer.compressor.{n}": f"indexer.{n}" for n in part}
    names |= {
        "indexer.q_proj.weight": "indexer.q_b_proj.weight",
        "indexer.weights_proj.weight": "indexer.scorer.weights_proj.weight",
    }
    _load(ours, theirs, names)
    x, q_latent = _inputs(2, SEQ, 32), _inputs(2, SEQ, 12)
    positions = torch.arange(SEQ)[None].expand(2, -1)
    hf_entries, bias = theirs(x, q_latent, positions, None, 0)
    cos, sin = _compress_rope()
    windows = Windows.of(positions, torch.zeros_like(positions), 4)
    entries = compressor(x, cos, sin, windows)
    visible = windows.visible()
    chosen = indexer(x, q_latent, cos, sin, windows, torch.arange(SEQ))
    assert max_rel_err(entries, hf_entries[:, 0]) < 1e-6
    assert torch.equal(chosen, bias[:, 0] == 0)
    # The last queries see 6 entries and keep 3: the choice decides.
    assert (chosen & ~visible).sum() == 0 and (chosen[:, -1].sum(-1) == 3).all()
    probe = torch.randn_like(entries)
    (hf_entries[:, 0] * probe).sum().backward()
    (entries * probe).sum().backward()
    _check_grads(ours, theirs, names)
