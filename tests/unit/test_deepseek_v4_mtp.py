"""DeepSeek V4's multi-token prediction against a hand composition of transformers' V4 parts.

transformers does not run V4's MTP (it drops ``mtp.*``), so the reference is built here from
its pieces on the same tensors: the main model's last streams (a hook on its last layer), the
next tokens' embedding, ``e_proj``/``h_proj`` over the two RMS-normed inputs, a transformers
``DeepseekV4DecoderLayer`` (sliding window, top-k experts) and a hyper head and norm of a
one-layer transformers model whose tensors are saved as ``mtp.0.*``, then the shared head.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hf_parity import earliest_first_topk, max_rel_err
from safetensors.torch import load_file, save_file
from test_deepseek_v4 import CONFIG, SEQ, tiny_hf
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion
from transformers.masking_utils import create_sliding_window_causal_mask

from temper.data.batch import IGNORE_INDEX
from temper.models import build_model, load_hf, save_hf
from temper.models.hf import adapter_of
from temper.objectives import CausalLM

WEIGHT = 0.3
MTP_CONFIG = copy.deepcopy(CONFIG)
MTP_CONFIG.num_hidden_layers = 1
MTP_CONFIG.layer_types = ["sliding_attention"]
MTP_CONFIG.mlp_layer_types = ["moe"]


@pytest.fixture(autouse=True)
def _ties_decided_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers selects with ``topk``, whose order among equal scores is unspecified:
    here it decides ties as ``select_top_k`` does (``earliest_first_topk``)."""
    monkeypatch.setattr(torch.Tensor, "topk", earliest_first_topk)


def _randomized(model: PreTrainedModel) -> PreTrainedModel:
    """As ``tiny_hf`` randomizes: norms, scales, sinks, biases and gates off their init."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(("sinks", "base", "mlp.gate.weight", "fn")):
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.3, 0.3)
    return model


def _mtp_name(name: str) -> str:
    """A one-layer transformers model's saved name -> the released MTP depth's."""
    if name.startswith("model.hc_head.hc_"):
        return "mtp.0.hc_head_" + name.removeprefix("model.hc_head.hc_")
    if name == "model.norm.weight":
        return "mtp.0.norm.weight"
    return name.replace("model.layers.0.", "mtp.0.", 1)


def folder_with_mtp(folder: Path) -> tuple[PreTrainedModel, PreTrainedModel, dict]:
    """``tiny_hf``'s folder plus one MTP depth: the block, hyper head and norm of a seeded
    one-layer transformers model, and random ``e_proj``, ``h_proj``, ``enorm``, ``hnorm``.
    Returns the main model, the one-layer one and those four tensors (leaves with grad)."""
    main = tiny_hf(folder)
    torch.manual_seed(1)
    depth = _randomized(AutoModelForCausalLM.from_config(MTP_CONFIG)).eval()
    depth.save_pretrained(folder / "depth")
    saved = load_file(folder / "depth" / "model.safetensors")
    block = {
        _mtp_name(k): v
        for k, v in saved.items()
        if k.startswith(("model.layers.0.", "model.hc_", "model.norm"))
    }
    d = CONFIG.hidden_size
    own = {
        "mtp.0.e_proj.weight": torch.randn(d, d) * 0.2,
        "mtp.0.h_proj.weight": torch.randn(d, d) * 0.2,
        "mtp.0.enorm.weight": torch.rand(d) + 0.5,
        "mtp.0.hnorm.weight": torch.rand(d) + 0.5,
    }
    weights = folder / "model.safetensors"
    save_file(load_file(weights) | block | own, weights, metadata={"format": "pt"})
    return main, depth, {k: v.clone().requires_grad_() for k, v in own.items()}


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + CONFIG.rms_norm_eps) * weight


def hand_loss(
    main: PreTrainedModel, depth: PreTrainedModel, own: dict, ids: torch.Tensor
) -> torch.Tensor:
    """transformers' main CE sum plus WEIGHT x the depth's CE sum over tokens two ahead."""
    captured = {}
    hook = main.model.layers[-1].register_forward_hook(
        lambda module, args, out: captured.__setitem__("streams", out)
    )
    logits = main(ids).logits
    hook.remove()
    main_ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
    embedded = main.model.embed_tokens(ids.roll(-1, dims=1))
    streams = captured["streams"]
    x = F.linear(_rms(embedded, own["mtp.0.enorm.weight"]), own["mtp.0.e_proj.weight"])
    x = x[:, :, None] + F.linear(
        _rms(streams, own["mtp.0.hnorm.weight"]), own["mtp.0.h_proj.weight"]
    )
    positions = torch.arange(ids.shape[1])[None]
    inner = depth.model
    mask = create_sliding_window_causal_mask(
        config=inner.config,
        inputs_embeds=embedded,
        attention_mask=None,
        cache=None,
        position_ids=positions,
    )
    rotary = {
        kind: inner.rotary_emb(embedded, position_ids=positions, layer_type=kind)
        for kind in ("main", "compress")
    }
    out = inner.layers[0](
        x, position_embeddings=rotary, position_ids=positions, attention_mask=mask, input_ids=ids
    )
    hidden = inner.norm(inner.hc_head(out))
    draft = F.linear(hidden, main.lm_head.weight)
    mtp_ce = F.cross_entropy(draft[:, :-2].flatten(0, 1), ids[:, 2:].flatten(), reduction="sum")
    return main_ce + WEIGHT * mtp_ce


def test_mtp_matches_a_hand_composition_of_transformers_parts(tmp_path: Path) -> None:
    """The loaded depth's loss (main CE + 0.3 x draft CE, summed) and every parameter's
    gradient, the main model's and the depth's, equal the hand composition's (1e-5); the
    main logits are transformers' with MTP on."""
    main, depth, own = folder_with_mtp(tmp_path / "hf")
    native = load_hf(tmp_path / "hf", overrides={"mtp_loss_weight": WEIGHT})
    assert native.args.mtp_depth == 1
    native.train()
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(0))
    labels = F.pad(ids[:, 1:], (0, 1), value=IGNORE_INDEX)
    with torch.no_grad():
        torch.testing.assert_close(native(ids), main(ids).logits, rtol=1e-5, atol=1e-6)
    loss_sum, _, metrics = CausalLM().loss(native, {"input_ids": ids, "labels": labels})
    expected = hand_loss(main, depth, own, ids)
    assert loss_sum.item() == pytest.approx(expected.item(), rel=1e-6)
    assert "mtp_loss" in metrics and "mtp_accuracy" in metrics
    loss_sum.backward()
    expected.backward()
    hf_grads = revert_weight_conversion(
        main, {n: p.grad for n, p in main.named_parameters() if p.grad is not None}
    )
    depth_grads = revert_weight_conversion(
        depth, {n: p.grad for n, p in depth.named_parameters() if p.grad is not None}
    )
    hf_grads |= {_mtp_name(k): v for k, v in depth_grads.items()}
    hf_grads |= {k: v.grad for k, v in own.items()}
    params = dict(native.named_parameters())
    checked = 0
    for rule in adapter_of(native).key_rules(native.args):
        got = params[rule.native].grad
        if rule.hf[0] not in hf_grads:
            assert got is None and ".indexer." in rule.native, rule.native
            continue
        expected_grad = torch.stack([hf_grads[k] for k in rule.hf]).view_as(got)
        assert max_rel_err(got, expected_grad) < 1e-5, rule.native
        checked += rule.native.startswith("mtp.")
    assert checked == len([n for n in params if n.startswith("mtp.")])


def test_mtp_leaves_the_main_model_alone_and_round_trips(tmp_path: Path) -> None:
    """With the depth loaded and running (training mode), the logits and the main loss's
    gradients are those of the model without it; the folder round-trips bit-identically
    (``mtp.0.*`` included), and a model without MTP (mtp_depth 0) carries the folder's MTP
    tensors through its export untouched."""
    folder_with_mtp(tmp_path / "hf")
    with_mtp = load_hf(tmp_path / "hf").train()
    without = load_hf(tmp_path / "hf", overrides={"mtp_depth": 0}).train()
    assert (with_mtp.args.mtp_depth, without.args.mtp_depth) == (1, 0)
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(0))
    logits = {}
    for model in (with_mtp, without):
        logits[model] = model(ids)
        F.cross_entropy(logits[model][:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    assert len(with_mtp.mtp_hidden) == 1 and not without.mtp_hidden
    assert torch.equal(logits[with_mtp], logits[without])
    for name, param in without.named_parameters():
        theirs = with_mtp.get_parameter(name).grad
        assert (param.grad is None and theirs is None) or torch.equal(param.grad, theirs), name
    source = load_file(tmp_path / "hf" / "model.safetensors")
    for model, out in ((with_mtp, "out"), (without, "carried")):
        save_hf(model, tmp_path / out, carry_from=tmp_path / "hf")
        written = load_file(tmp_path / out / "model.safetensors")
        assert written.keys() == source.keys()
        assert all(torch.equal(written[k], source[k]) for k in source), out


def test_flops_count_each_depth_as_a_sliding_layer_and_a_head() -> None:
    """A depth adds 6 FLOPs per active weight (its routed experts at top_k / n_experts), 6
    per head weight (the shared head applied again) and the sliding window's attention."""
    plain = build_model("deepseek_v4", "debug")
    with_mtp = build_model("deepseek_v4", "debug", overrides={"mtp_depth": 1})
    args, depth = with_mtp.args, with_mtp.mtp[0]
    experts = sum(p.numel() for p in depth.block.feed_forward.experts.parameters())
    active = sum(p.numel() for p in depth.parameters()) - experts * (1 - 2 / 8)
    window = 12 * args.n_heads * args.head_dim * args.sliding_window
    expected = 6 * active + 6 * args.vocab_size * args.dim + window
    added = with_mtp.flops_per_token(256) - plain.flops_per_token(256)
    assert added == pytest.approx(expected, rel=1e-12)
