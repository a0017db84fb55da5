"""DeepSeek V3 multi-token prediction: off changes nothing, on is the hand-composed loss of its
modules, and an HF folder carries it both ways."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from temper.data.batch import IGNORE_INDEX
from temper.kernels.attention import DocumentMask
from temper.models import load_hf, materialize, save_hf
from temper.models.deepseek_v3 import DeepseekV3Args, DeepseekV3Transformer
from temper.models.layers.context import ForwardContext
from temper.models.layers.rope import rope_cos_sin
from temper.objectives.causal_lm import CausalLM

TINY = DeepseekV3Args(
    dim=48,
    n_layers=2,
    n_heads=4,
    vocab_size=96,
    ffn_hidden_dim=64,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    n_dense_layers=1,
    n_experts=4,
    n_shared_experts=1,
    top_k=2,
    moe_hidden_dim=16,
    n_groups=2,
    topk_group=1,
    routed_scaling_factor=2.0,
)
# Two packed documents per row: 7 + 9 tokens, and 12 + 4.
POSITIONS = torch.tensor([[*range(7), *range(9)], [*range(12), *range(4)]])


def tiny(mtp_depth: int, seed: int = 0) -> DeepseekV3Transformer:
    with torch.device("meta"):
        model = DeepseekV3Transformer(dataclasses.replace(TINY, mtp_depth=mtp_depth))
    torch.manual_seed(seed)
    return materialize(model, "cpu").train()


def batch(packed: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (2, 17), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, 3] = IGNORE_INDEX  # a masked label, as an SFT prompt token
    out = {"input_ids": ids[:, :-1], "labels": labels}
    if packed:
        out["position_ids"] = POSITIONS
    return out


def test_mtp_off_changes_nothing() -> None:
    """Depth 0 has no MTP parameter or metric; a depth-1 model from the same seed has the same
    main weights (its depth is initialized after them), the same logits bit for bit, and its
    main loss is the depth-0 loss bit for bit (the draft adds a separate term)."""
    plain, drafted = tiny(0), tiny(1)
    assert not [n for n, _ in plain.named_parameters() if "mtp" in n]
    main = dict(drafted.named_parameters())
    for name, param in plain.named_parameters():
        assert torch.equal(param, main[name]), name
    b = batch()
    args = (b["input_ids"], b["position_ids"], DocumentMask.from_position_ids(b["position_ids"]))
    assert torch.equal(plain(*args), drafted(*args))
    loss, n_tokens, metrics = CausalLM().loss(plain, b)
    assert "mtp_loss" not in metrics and "mtp_accuracy" not in metrics
    with torch.no_grad():
        drafted.args.mtp_loss_weight = 0.0
        drafted_loss, _, drafted_metrics = CausalLM().loss(drafted, b)
    assert torch.equal(loss, drafted_loss)
    assert {"mtp_loss", "mtp_accuracy"} <= set(drafted_metrics)
    # Eval mode and decoding never run the depths.
    drafted.eval()
    drafted(b["input_ids"])
    assert drafted.mtp_hidden == []


def _targets_by_hand(labels: torch.Tensor, positions: torch.Tensor, ahead: int) -> torch.Tensor:
    targets = torch.full_like(labels, IGNORE_INDEX)
    b, s = labels.shape
    for i in range(b):
        for t in range(s - ahead):
            if positions[i, t + ahead] == positions[i, t] + ahead:
                targets[i, t] = labels[i, t + ahead]
    return targets


@pytest.mark.parametrize("packed", [True, False])
def test_mtp_loss_is_the_hand_composition_of_its_modules(packed: bool) -> None:
    """Two depths: main CE sum + weight / 2 * sum_k CE_k, each depth written out from its
    modules (norms, eh_proj over [embedding of token t+k+1; previous hidden], block, norm,
    shared head), targets k+1 labels on inside the same document."""
    model = tiny(2)
    model.args.mtp_loss_weight = 0.4
    b = batch(packed)
    loss, n_tokens, metrics = CausalLM().loss(model, b)

    ids, labels = b["input_ids"], b["labels"]
    positions = b.get("position_ids", torch.arange(16).expand(2, 16))
    docs = DocumentMask.from_position_ids(b["position_ids"]) if packed else None
    hidden = model.hidden_states(ids, b.get("position_ids"), docs)
    logits = model.output(hidden)
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    cos, sin = rope_cos_sin(model.inv_freq, positions)
    drafts, correct, count = torch.zeros(()), 0, 0
    h = hidden
    for k, depth in enumerate(model.mtp):
        ahead = k + 1
        next_ids = torch.cat([ids[:, ahead:], ids[:, :ahead]], dim=1)
        x = depth.eh_proj(
            torch.cat([depth.enorm(model.tok_embeddings(next_ids)), depth.hnorm(h)], dim=-1)
        )
        h, _ = depth.block(x, ForwardContext(cos, sin, docs, "sdpa"))
        draft_logits = model.output(depth.norm(h))
        targets = _targets_by_hand(labels, positions, ahead)
        drafts = drafts + F.cross_entropy(
            draft_logits.flatten(0, 1), targets.flatten(), reduction="sum"
        )
        valid = targets != IGNORE_INDEX
        correct += int((draft_logits.argmax(-1) == targets)[valid].sum())
        count += int(valid.sum())
    expected = expected + 0.4 / 2 * drafts
    assert n_tokens == (labels != IGNORE_INDEX).sum()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    assert metrics["mtp_loss"] == pytest.approx(drafts.item() / count, rel=1e-6)
    assert metrics["mtp_accuracy"] == pytest.approx(correct / count)
    # The gradient reaches every depth and the shared embedding and head through the drafts.
    loss.backward()
    for name, param in model.named_parameters():
        if name.startswith("mtp.") and "experts" not in name:
            assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_hf_folder_carries_the_mtp_layer_both_ways(tmp_path: Path) -> None:
    """Export writes layer n_layers as DeepSeek-V3's hub folder holds its layer 61 (with the
    embedding and head copies); loading it with mtp_depth 1 gives back every tensor bit for bit;
    transformers reads the same folder as the model without MTP."""
    model = tiny(1)
    with torch.no_grad():
        for depth in model.mtp:
            for norm in (depth.enorm, depth.hnorm, depth.norm):
                norm.weight.uniform_(0.5, 1.5)
    save_hf(model, tmp_path / "out")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    layer = "model.layers.2"
    for key in (
        "enorm",
        "hnorm",
        "eh_proj",
        "shared_head.norm",
        "embed_tokens",
        "self_attn.o_proj",
    ):
        assert f"{layer}.{key}.weight" in saved, key
    assert torch.equal(saved[f"{layer}.shared_head.head.weight"], saved["lm_head.weight"])
    assert torch.equal(saved[f"{layer}.embed_tokens.weight"], saved["model.embed_tokens.weight"])
    assert f"{layer}.mlp.gate.e_score_correction_bias" in saved

    reloaded = load_hf(tmp_path / "out")  # the folder's count, and the layer it holds
    assert reloaded.args.mtp_depth == 1
    ours = model.state_dict()
    theirs = reloaded.state_dict()
    assert sorted(ours) == sorted(theirs)
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), key
    # The embedding and head stay shared with the draft after loading.
    assert not [
        n
        for n, _ in reloaded.named_parameters()
        if n.endswith(("embed_tokens.weight", "head.weight"))
    ]

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert hf.config.num_nextn_predict_layers == 1
    ids = batch(packed=False)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_missing_mtp_tensors_are_named(tmp_path: Path) -> None:
    save_hf(tiny(0), tmp_path / "out")
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.2\.enorm\.weight"):
        load_hf(tmp_path / "out", overrides={"mtp_depth": 1})


def test_mtp_depth_is_refused_by_name_for_other_families() -> None:
    from temper.models import build_model

    with pytest.raises(ValueError, match=r"model\.mtp_depth is not a setting of the llama3"):
        build_model("llama3", "debug", overrides={"mtp_depth": 1})


def test_a_folder_declaring_mtp_without_its_layer_loads_without_it(tmp_path: Path) -> None:
    """transformers writes num_nextn_predict_layers 1 (its default) and saves no MTP layer:
    such a folder is the model without MTP; one that holds the layer is read with it."""
    save_hf(tiny(1), tmp_path / "with")
    save_hf(tiny(0), tmp_path / "without")
    config = (tmp_path / "without" / "config.json").read_text()
    declared = config.replace('"num_nextn_predict_layers": 0', '"num_nextn_predict_layers": 1')
    assert declared != config
    (tmp_path / "without" / "config.json").write_text(declared)
    assert load_hf(tmp_path / "without").args.mtp_depth == 0
    assert load_hf(tmp_path / "with").args.mtp_depth == 1
    assert load_hf(tmp_path / "with", overrides={"mtp_depth": 0}).args.mtp_depth == 0


def test_dcp_checkpoint_round_trip_keeps_the_mtp_layer(tmp_path: Path) -> None:
    """HF folder -> DCP checkpoint -> HF folder (the conversion CLI's two steps) keeps every
    MTP tensor bit for bit."""
    from temper.assets import __file__ as assets
    from temper.checkpoint.convert import dcp_to_hf, hf_to_dcp, load_checkpoint_model

    model = tiny(1)
    save_hf(model, tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_bytes(
        (Path(assets).parent / "tokenizer.json").read_bytes()
    )
    hf_to_dcp(tmp_path / "hf", tmp_path / "ckpt")
    assert load_checkpoint_model(tmp_path / "ckpt").args.mtp_depth == 1
    dcp_to_hf(tmp_path / "ckpt", tmp_path / "out")
    before, after = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(tmp_path / "out" / "model.safetensors"),
    )
    assert sorted(before) == sorted(after)
    assert [k for k in after if k.startswith("model.layers.2.")]
    for key, value in before.items():
        assert torch.equal(value, after[key]), key


def test_flops_count_the_depths() -> None:
    with torch.device("meta"):
        plain = DeepseekV3Transformer(TINY)
        drafted = DeepseekV3Transformer(dataclasses.replace(TINY, mtp_depth=1))
    depth_params = sum(p.numel() for p in drafted.mtp.parameters())
    routed = sum(p.numel() for p in drafted.mtp[0].block.feed_forward.experts.parameters())
    active_depth = depth_params - routed * (1 - TINY.top_k / TINY.n_experts)
    head = TINY.vocab_size * TINY.dim
    attention = 6.0 * TINY.n_heads * (16 + 8) * 32  # one more layer's scores at 32 tokens
    expected = plain.flops_per_token(32) + 6.0 * (active_depth + head) + attention
    assert drafted.flops_per_token(32) == pytest.approx(expected, rel=1e-12)
