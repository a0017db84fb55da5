"""DeepSeek Sparse Attention: the layer on its own, and the `deepseek_v32` (DeepSeek V3.2) and
`glm_moe_dsa` (GLM-5) families against transformers' classes through HF folders on disk.

The tiny configs keep 6 keys per query (``index_topk``) of sequences of 24, so the indexer's
choice decides the outputs (``test_selection_decides_the_outputs`` shows that it does)."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_parity import (
    check_forward_and_grads,
    check_round_trip,
    earliest_first_topk,
    max_rel_err,
    randomize_norms,
)
from transformers import (
    AutoModelForCausalLM,
    DeepseekV32Config,
    GlmMoeDsaConfig,
    PreTrainedConfig,
    PreTrainedModel,
)

from temper.config import ConfigError, Parallelism
from temper.data.batch import IGNORE_INDEX
from temper.data.tokenizer import load_tokenizer
from temper.generation import decoding, generate
from temper.kernels.attention import DocumentMask, causal_band
from temper.models import build_model, get_model_spec, load_hf
from temper.models.deepseek_v32 import DeepseekV32Transformer
from temper.models.glm_moe_dsa import GlmMoeDsaArgs, GlmMoeDsaTransformer
from temper.models.glm_moe_dsa.args import as_glm
from temper.models.hf import read_hf_args
from temper.models.layers.context import ForwardContext
from temper.models.layers.mla import MLA
from temper.models.layers.rope import rope_cos_sin, rope_inv_freq
from temper.models.layers.sparse_attention import SparseMLA, indexer_kl, select_top_k
from temper.objectives.causal_lm import CausalLM, label_log_probs
from temper.objectives.dpo import DPO, DPOConfig
from temper.objectives.grpo import GRPO, GRPOConfig
from temper.objectives.rollout import COMPLETION_LENGTHS

_BASE = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 80,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 20,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 12,
    "qk_rope_head_dim": 8,
    "v_head_dim": 10,
    "n_routed_experts": 8,
    "n_group": 2,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "index_n_heads": 4,
    "index_head_dim": 16,  # 8 rotary dims, 8 without
    "index_topk": 6,
    "rms_norm_eps": 1e-5,
    "bos_token_id": None,
    "eos_token_id": None,
}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 0.9,
    "mscale_all_dim": 0.7,
}
CASES: dict[str, tuple[PreTrainedConfig, type]] = {
    "deepseek_v32": (DeepseekV32Config(**_BASE), DeepseekV32Transformer),
    # YaRN: its attention factor scales the indexer's rotary too.
    "deepseek_v32_yarn": (
        DeepseekV32Config(**_BASE, max_position_embeddings=64, rope_parameters=YARN),
        DeepseekV32Transformer,
    ),
    "glm_moe_dsa": (
        GlmMoeDsaConfig(**_BASE, routed_scaling_factor=1.5, norm_topk_prob=False),
        GlmMoeDsaTransformer,
    ),
    # Layer 1 attends to layer 0's choice; layer 2 runs its own indexer again.
    "glm_moe_dsa_shared": (
        GlmMoeDsaConfig(**_BASE, indexer_types=["full", "shared", "full"]),
        GlmMoeDsaTransformer,
    ),
}


@pytest.fixture(autouse=True)
def _ties_decided_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers selects with ``topk``, whose order among equal scores is unspecified:
    here it decides ties as ``select_top_k`` does (``earliest_first_topk``)."""
    monkeypatch.setattr(torch.Tensor, "topk", earliest_first_topk)


def tiny_hf(config: PreTrainedConfig, folder: Path) -> PreTrainedModel:
    """A seeded random HF model (random norms, the indexer's LayerNorm bias included; a
    decisive router and a random expert bias, as DeepSeek V3's test does), saved."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    randomize_norms(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.3, 0.3)
    model.save_pretrained(folder)
    return model.eval()


# The layer on its own.


def _sparse_mla(topk: int) -> SparseMLA:
    torch.manual_seed(0)
    layer = SparseMLA(
        32, 2, 12, 8, 6, 4, 5, index_n_heads=3, index_head_dim=8, index_topk=topk,
        index_rope_interleaved=False, softmax_scale=0.3,
    )  # fmt: skip
    layer.init_weights(0.2, 0.2)
    return layer


def _rope(position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_cos_sin(rope_inv_freq(4, 10000.0, None), position_ids)


def test_selection_keeps_top_k_visible_keys_only() -> None:
    """Each query keeps min(topk, visible) keys, the best-scored, never a hidden one."""
    scores = torch.randn(2, 10, 10, generator=torch.Generator().manual_seed(0))
    docs = DocumentMask.from_position_ids(torch.tensor([list(range(6)) + list(range(4))] * 2))
    visible = docs.dense()[:, 0]
    chosen = select_top_k(scores, visible, 3)
    assert not (chosen & ~visible).any()
    assert chosen.sum(-1).tolist() == [[1, 2, 3, 3, 3, 3, 1, 2, 3, 3]] * 2
    worst_kept = scores.masked_fill(~chosen, float("inf")).amin(-1)
    best_dropped = scores.masked_fill(chosen | ~visible, float("-inf")).amax(-1)
    assert (worst_kept > best_dropped).all()


def test_selection_breaks_ties_towards_the_earliest_key() -> None:
    """ReLU scores tie at exact zeros: each query keeps its best keys, then the earliest of the
    tied ones (a hand sort on (-score, index)), and a row padded by one invisible key and
    query chooses what it chose unpadded (``topk`` chose differently at these lengths)."""
    g = torch.Generator().manual_seed(0)
    for t in (16, 40, 79):
        scores = (
            torch.randn(2, t, t, generator=g) * (torch.rand(2, t, t, generator=g) < 0.3)
        ).relu()
        visible = causal_band(t, t, None, torch.device("cpu"))[None].expand(2, t, t)
        chosen = select_top_k(scores, visible, 8)
        padded = select_top_k(F.pad(scores, (0, 1, 0, 1)), F.pad(visible, (0, 1, 0, 1)), 8)
        assert torch.equal(padded[:, :t, :t], chosen)
        for b, i in ((0, t - 1), (1, t // 2), (1, 3)):
            keys = sorted(range(i + 1), key=lambda j: (-float(scores[b, i, j]), j))[:8]
            assert chosen[b, i].nonzero().flatten().tolist() == sorted(keys)


def test_sparse_mla_with_every_key_kept_is_mla() -> None:
    """topk >= the sequence: the masked reference is MLA's dense causal attention (the same
    projections), with and without packed documents."""
    layer = _sparse_mla(topk=16)
    dense = MLA(32, 2, 12, 8, 6, 4, 5, softmax_scale=0.3, rope_interleaved=True)
    dense.load_state_dict(layer.state_dict(), strict=False)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([list(range(9)) + list(range(7))] * 2)
    cos, sin = _rope(positions)
    docs = DocumentMask.from_position_ids(positions)
    for d in (None, docs):
        ctx = ForwardContext(cos, sin, d)
        torch.testing.assert_close(layer(x, ctx)[0], dense(x, ctx), rtol=0, atol=1e-6)
    sparse = _sparse_mla(topk=4)
    ctx = ForwardContext(cos, sin)
    assert max_rel_err(sparse(x, ctx)[0], dense(x, ctx)) > 1e-2


def test_packed_documents_attend_as_alone() -> None:
    """Two documents in one row give each document's own outputs (selection within it)."""
    layer = _sparse_mla(topk=4)
    x = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(2))
    positions = torch.tensor([list(range(9)) + list(range(7))])
    cos, sin = _rope(positions)
    packed, _ = layer(x, ForwardContext(cos, sin, DocumentMask.from_position_ids(positions)))
    first, _ = layer(x[:, :9], ForwardContext(cos[:, :9], sin[:, :9]))
    second, _ = layer(x[:, 9:], ForwardContext(cos[:, 9:], sin[:, 9:]))
    torch.testing.assert_close(packed, torch.cat([first, second], 1), rtol=0, atol=1e-6)


# The families against transformers.


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers(case: str, tmp_path: Path) -> None:
    """Logits, loss and every gradient (none for the indexer, on both sides) at fp32."""
    config, model_cls = CASES[case]
    hf = tiny_hf(config, tmp_path)
    native = load_hf(tmp_path)
    assert type(native) is model_cls
    errors = check_forward_and_grads(hf, native, seq_len=24, grad_rtol=1e-5)
    assert errors["logits"] <= 1e-5


@pytest.mark.parametrize("case", ["deepseek_v32", "glm_moe_dsa"])
def test_selection_decides_the_outputs(case: str, tmp_path: Path) -> None:
    """Keeping every key, or the other family's indexer rotary, moves the logits well past
    the tolerance: the parity above checks the selection itself."""
    config, model_cls = CASES[case]
    hf = tiny_hf(config, tmp_path)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
        dense = load_hf(tmp_path, overrides={"index_topk": 24})
        assert max_rel_err(dense(ids), expected) > 1e-3
        other_cls = (
            GlmMoeDsaTransformer
            if model_cls is DeepseekV32Transformer
            else (DeepseekV32Transformer)
        )
        native = load_hf(tmp_path)
        other = other_cls(native.args)
        other.load_state_dict(native.state_dict())
        assert max_rel_err(other(ids), expected) > 1e-3


@pytest.mark.parametrize("case", ["deepseek_v32", "glm_moe_dsa_shared"])
def test_packed_row_equals_each_document_alone(case: str, tmp_path: Path) -> None:
    """Documents of 14 and 10 tokens (both longer than index_topk) in one row: the native
    model gives each transformers' logits for that document alone."""
    hf = tiny_hf(CASES[case][0], tmp_path)
    native = load_hf(tmp_path)
    ids = torch.randint(1, 96, (1, 24), generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([list(range(14)) + list(range(10))])
    with torch.no_grad():
        packed = native(ids, positions, DocumentMask.from_position_ids(positions))
        alone = torch.cat([hf(ids[:, :14]).logits, hf(ids[:, 14:]).logits], 1)
    assert max_rel_err(packed, alone) <= 1e-5


@pytest.mark.parametrize("case", ["deepseek_v32", "glm_moe_dsa", "glm_moe_dsa_shared"])
def test_greedy_generation_equals_transformers(case: str, tmp_path: Path) -> None:
    """Left-padded prompts decoded with Temper's KV cache (the indexer's keys cached too) past
    index_topk tokens: transformers' greedy generate's tokens."""
    hf = tiny_hf(CASES[case][0], tmp_path)
    native = load_hf(tmp_path)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [14, 15, 16], [40, 41, 42, 43, 44]]
    width, new = max(map(len, prompts)), 12
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (ids != 0).long()
    with torch.no_grad():
        theirs = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    ours = generate(native, prompts, new, pad_id=0)
    assert ours.tokens.tolist() == theirs[:, width:].tolist()


def test_static_cache_decodes_as_the_growing_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``compile=True``'s static cache (its step run eagerly here: the cache's indexing is
    what is checked, not the compiler) keeps the indexer's keys alike."""
    tiny_hf(CASES["deepseek_v32"][0], tmp_path)
    native = load_hf(tmp_path)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [14, 15, 16]]
    growing = generate(native, prompts, 12, pad_id=0).tokens
    monkeypatch.setattr(decoding, "compiled_decode_step", lambda: decoding.decode_step)
    static = generate(native, prompts, 12, pad_id=0, compile=True).tokens
    assert static.tolist() == growing.tolist()


@pytest.mark.parametrize("case", ["deepseek_v32", "glm_moe_dsa", "glm_moe_dsa_shared"])
def test_round_trip_is_bit_identical(case: str, tmp_path: Path) -> None:
    hf = tiny_hf(CASES[case][0], tmp_path / "hf")
    check_round_trip(tmp_path / "hf", tmp_path / "out", hf)
    assert read_hf_args(tmp_path / "out") == read_hf_args(tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").config
    assert type(reloaded) is type(hf.config)
    for field in ("index_n_heads", "index_head_dim", "index_topk", "q_lora_rank"):
        assert getattr(reloaded, field) == getattr(hf.config, field), field


def test_shared_layers_hold_no_indexer_and_patterns_read_alike(tmp_path: Path) -> None:
    """GLM's cross-layer sharing: a shared layer has no indexer tensors, natively or in the
    folder, and the pattern and frequency spellings give the same args."""
    hf = tiny_hf(CASES["glm_moe_dsa_shared"][0], tmp_path)
    native = load_hf(tmp_path)
    assert native.args.indexer_types == ("full", "shared", "full")
    assert native.layers[1].attention.indexer is None
    assert not any(".layers.1.self_attn.indexer" in n for n, _ in hf.named_parameters())
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["indexer_types"]
    adapter = get_model_spec("glm_moe_dsa").hf_adapter
    assert adapter is not None
    spellings = [{"index_topk_pattern": "FSF"}, {"index_topk_freq": 2, "index_skip_topk_offset": 1}]
    for spelling in spellings:
        assert GlmMoeDsaConfig(**_BASE, **spelling).indexer_types == ["full", "shared", "full"]
        assert adapter.args_from_hf(saved | spelling) == native.args, spelling
    assert adapter.args_from_hf(saved).indexer_types == ()  # no spelling: every layer full


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_layout_takes_context_parallel(family: str) -> None:
    """CP, alone or with SP, passes the layout rule (its parity: test_dsa_context_parallel);
    the decoder rule still holds (heads over SP)."""
    spec = get_model_spec(family)
    args = spec.flavors["debug"]
    for parallelism in (Parallelism(ep=2, sp=2), Parallelism(cp=2), Parallelism(cp=2, sp=2)):
        spec.check_layout(args, parallelism)
    with pytest.raises(ConfigError, match="sp"):
        spec.check_layout(args, Parallelism(cp=2, sp=args.n_heads + 1))


def test_flops_count_the_sparse_work() -> None:
    """Past index_topk the attention term stops growing; the indexer's grows with the
    sequence: the step between two lengths is the indexer's alone."""
    args = get_model_spec("deepseek_v32").flavors["debug"]
    with torch.device("meta"):
        model = DeepseekV32Transformer(dataclasses.replace(args, index_topk=64))
    step = model.flops_per_token(256) - model.flops_per_token(128)
    assert step == 2.0 * args.n_layers * args.index_n_heads * args.index_head_dim * 128


# Training the indexer.


def test_indexer_kl_is_the_divergence_over_the_allowed_keys() -> None:
    """Against ``F.kl_div`` one query at a time: the heads' attention over the query's allowed
    keys, summed and normalized, is the target of the indexer's log-softmax there."""
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 7, 3, 5, generator=g), torch.randn(2, 7, 3, 5, generator=g)
    scores = torch.randn(2, 7, 7, generator=g)
    visible = causal_band(7, 7, None, "cpu")[None].expand(2, 7, 7)
    allowed = select_top_k(torch.randn(2, 7, 7, generator=g), visible, 3)
    by_hand = []
    for b in range(2):
        for t in range(7):
            keep = allowed[b, t]
            attention = (torch.einsum("hd,khd->hk", q[b, t], k[b, keep]) * 0.4).softmax(-1)
            target = attention.sum(0) / attention.sum()
            log_q = scores[b, t, keep].log_softmax(-1)
            by_hand.append(F.kl_div(log_q, target, reduction="sum"))
    got = indexer_kl(q, k, scores, allowed, 0.4)
    torch.testing.assert_close(got, torch.stack(by_hand).view(2, 7), rtol=1e-6, atol=1e-7)


def _lm_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(5))
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    return {"input_ids": ids, "labels": labels}


def test_sparse_mode_trains_the_indexer_by_its_kl_only(tmp_path: Path) -> None:
    """``sparse``: the same logits and main-weight gradients as ``off`` (the KL reaches no
    other weight), the indexers' gradients from the KL term, which the objective adds with
    its weight and logs."""
    tiny_hf(CASES["deepseek_v32"][0], tmp_path)
    batch = _lm_batch()
    off = load_hf(tmp_path).train()
    loss_off, n_tokens, metrics = CausalLM().loss(off, batch)
    assert "indexer_kl" not in metrics and off.indexer_loss() is None
    loss_off.backward()
    sparse = load_hf(tmp_path, overrides={"indexer_training": "sparse"}).train()
    loss_sparse, _, metrics = CausalLM().loss(sparse, batch)
    kl = sparse.indexer_loss()
    assert kl is not None and kl.item() > 0 and metrics["indexer_kl"] == kl.item()
    torch.testing.assert_close(loss_sparse, loss_off + kl * n_tokens, rtol=1e-6, atol=0)
    loss_sparse.backward()
    theirs = dict(off.named_parameters())
    for name, param in sparse.named_parameters():
        if ".indexer." in name:
            assert theirs[name].grad is None and param.grad.abs().sum() > 0, name
        else:
            assert torch.equal(param.grad, theirs[name].grad), name


def test_dense_warmup_attends_densely_and_trains_only_the_indexers(tmp_path: Path) -> None:
    """``dense_warmup``: the logits of the model keeping every key; only the indexers
    require gradients, and a few steps on the objective lower their KL."""
    tiny_hf(CASES["glm_moe_dsa"][0], tmp_path)
    batch = _lm_batch()
    model = load_hf(tmp_path, overrides={"indexer_training": "dense_warmup"})
    dense = load_hf(tmp_path, overrides={"index_topk": 24}).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(batch["input_ids"]), dense(batch["input_ids"]))
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".indexer." in name for name in trained)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    kls = []
    for _ in range(8):
        loss, n_tokens, metrics = CausalLM().loss(model, batch)
        (loss / n_tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
        kls.append(metrics["indexer_kl"].item())
    assert kls[-1] < 0.8 * kls[0], kls


def test_unsupported_settings_are_refused_by_name(tmp_path: Path) -> None:
    adapter = get_model_spec("deepseek_v32").hf_adapter
    assert adapter is not None
    config = DeepseekV32Config(**_BASE).to_dict()
    with pytest.raises(ValueError, match="mlp_layer_types"):
        adapter.args_from_hf(config | {"mlp_layer_types": ["dense", "sparse", "dense"]})
    with pytest.raises(ValueError, match="q_lora_rank is required"):
        adapter.args_from_hf(config | {"q_lora_rank": None})
    with pytest.raises(ValueError, match="index_head_dim 4 must be >= qk_rope_head_dim 8"):
        adapter.args_from_hf(config | {"index_head_dim": 4})
    args = get_model_spec("deepseek_v32").flavors["debug"]
    with pytest.raises(ValueError, match="indexer_training 'dense'"):
        dataclasses.replace(args, indexer_training="dense")
    with pytest.raises(ValueError, match="indexer_types\\[0\\] must be 'full'"):
        GlmMoeDsaArgs(**{**vars(as_glm(args)), "indexer_types": ("shared",) * args.n_layers})


def test_dpo_and_grpo_add_the_indexer_kl_term() -> None:
    """DPO and GRPO on deepseek_v32 debug with training indexers (weight 0.5): each loss per
    unit is the objective's own, by hand from its logged values, plus 0.5 x the logged
    ``indexer_kl``, and the indexers get gradients (from that term only)."""
    torch.manual_seed(0)
    overrides = {"indexer_training": "sparse", "indexer_loss_weight": 0.5}
    model = build_model("deepseek_v32", "debug", device="cpu", vocab_size=96, overrides=overrides)
    model.train()
    reference = copy.deepcopy(model).eval()
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(5))
    labels = ids.masked_fill(torch.arange(16) < 6, IGNORE_INDEX)  # prompts of 6 tokens

    # DPO (sigmoid), one pair: -log sigmoid of the logged reward margin, plus the KL term.
    pair = {"chosen_input_ids": ids[:1], "chosen_labels": labels[:1]}
    pair |= {"rejected_input_ids": ids[1:2], "rejected_labels": labels[1:2]}
    loss, pairs, metrics = DPO(DPOConfig(), reference=reference).loss(model, pair)
    dpo = -F.logsigmoid(metrics["rewards_chosen"] - metrics["rewards_rejected"])
    assert metrics["indexer_kl"] > 0
    torch.testing.assert_close(loss / pairs, dpo + 0.5 * metrics["indexer_kl"])
    _assert_indexers_get_gradients(model, loss)

    # GRPO on-policy, one update: the ratio is 1, so the loss per completion token is minus
    # the token-weighted mean advantage, plus the KL term.
    with torch.no_grad():
        log_probs = label_log_probs(model, ids, labels)
    completion = labels != IGNORE_INDEX
    advantages = torch.tensor([1.0, -0.5, 0.25, 2.0])
    rows = {"input_ids": ids, "labels": labels, "sampler_log_probs": log_probs}
    rows |= {"advantages": advantages, COMPLETION_LENGTHS: completion.sum(dim=1)}
    objective = GRPO(
        GRPOConfig(max_new_tokens=10), tokenizer=load_tokenizer(None), stop_tokens=set()
    )
    loss, count, metrics = objective.loss(model, rows)
    grpo = -(advantages[:, None] * completion).sum() / completion.sum()
    assert count == completion.sum() and metrics["indexer_kl"] > 0
    torch.testing.assert_close(loss / count, grpo + 0.5 * metrics["indexer_kl"])
    _assert_indexers_get_gradients(model, loss)


def _assert_indexers_get_gradients(model: torch.nn.Module, loss: torch.Tensor) -> None:
    model.zero_grad()
    loss.backward()
    indexers = [p.grad for name, p in model.named_parameters() if ".indexer." in name]
    assert indexers and all(g is not None and g.abs().sum() > 0 for g in indexers)
