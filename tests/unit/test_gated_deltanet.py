"""Gated DeltaNet pieces: the chunked rule against the token-by-token recurrence, packed
documents kept apart by both the convolution and the recurrence, the hybrids' published sizes
against transformers' parameter counts, and the SP head rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
)

from temper.config import ConfigError
from temper.kernels import dispatch, gated_delta
from temper.kernels.attention import DocumentMask
from temper.kernels.gated_delta import (
    chunk_gated_delta_rule,
    gated_delta_rule,
    recurrent_gated_delta_rule,
)
from temper.models import build_model, get_model_spec, materialize
from temper.models.fit import check_linear_attention_heads
from temper.models.layers.gated_deltanet import l2_normalize
from temper.models.lora import apply_lora, init_lora, lora_modules, merge_lora


def _rule_inputs(b: int, s: int, h: int, d_k: int, d_v: int, max_rate: float, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(b, s, h, d_k, generator=gen, dtype=torch.float64)) * d_k**-0.5
    k = l2_normalize(torch.randn(b, s, h, d_k, generator=gen, dtype=torch.float64))
    v = torch.randn(b, s, h, d_v, generator=gen, dtype=torch.float64)
    g = -max_rate * torch.rand(b, s, h, generator=gen, dtype=torch.float64)
    beta = torch.rand(b, s, h, generator=gen, dtype=torch.float64)
    state = torch.randn(b, h, d_k, d_v, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("chunk", [4, 16, 64])
@pytest.mark.parametrize("max_rate", [0.1, 20.0])
def test_chunked_rule_equals_the_recurrence(chunk: int, max_rate: float) -> None:
    """fp64, 37 tokens (a partial last chunk), a starting state; log decays up to -20 per
    token (HF's init range) as well as mild ones."""
    q, k, v, g, beta, state = _rule_inputs(2, 37, 3, 8, 6, max_rate)
    expected, expected_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk=chunk)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, expected_state, rtol=1e-10, atol=1e-10)


def test_chunked_rule_gradients_equal_the_recurrence() -> None:
    inputs = [t.requires_grad_() for t in _rule_inputs(1, 21, 2, 4, 5, 1.0)]
    weights = torch.randn(1, 21, 2, 5, dtype=torch.float64)
    (recurrent_gated_delta_rule(*inputs)[0] * weights).sum().backward()
    expected = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    (chunk_gated_delta_rule(*inputs, chunk=8)[0] * weights).sum().backward()
    for t, e in zip(inputs, expected, strict=True):
        torch.testing.assert_close(t.grad, e, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_packed_documents_equal_each_document_alone(family: str) -> None:
    """Three documents packed in one row (and one alone in a second row): every document's
    logits and loss equal those of the document run by itself, so neither the convolution
    window nor the recurrent state (nor attention) crosses a document start."""
    torch.manual_seed(0)
    model = build_model(family, "debug", device="cpu", vocab_size=64)
    with torch.no_grad():  # decay rates that keep the state carrying tokens along
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.05, 1.0).log())
    lengths = [7, 12, 5]
    docs = [torch.randint(0, 64, (n,)) for n in lengths]
    row = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = model(row, positions, DocumentMask.from_position_ids(positions))
    start = 0
    for doc in docs:
        alone = model(doc[None])
        got = packed[:, start : start + doc.numel()]
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
        loss_alone = F.cross_entropy(alone[0, :-1], doc[1:])
        loss_packed = F.cross_entropy(got[0, :-1], doc[1:])
        assert loss_packed.item() == pytest.approx(loss_alone.item(), rel=1e-6)
        start += doc.numel()


_REAL = {
    "qwen3_next/80b_a3b": (Qwen3NextConfig, {}),
    "qwen3_5/9b": (Qwen3_5TextConfig, {}),
    "qwen3_5_moe/35b_a3b": (Qwen3_5MoeTextConfig, {}),
    "qwen3_5_moe/397b_a17b": (
        Qwen3_5MoeTextConfig,
        dict(
            hidden_size=4096,
            num_hidden_layers=60,
            num_attention_heads=32,
            linear_num_value_heads=64,
            num_experts=512,
            num_experts_per_tok=10,
            moe_intermediate_size=1024,
            shared_expert_intermediate_size=1024,
        ),
    ),
}


@pytest.mark.parametrize("name", list(_REAL))
def test_published_sizes_count_as_transformers(name: str) -> None:
    """On the meta device: the flavor's parameter count equals transformers' model built from
    the config the adapter writes for it, and that config reads back to the same args."""
    family, flavor = name.split("/")
    spec = get_model_spec(family)
    native = build_model(family, flavor)
    hf_config = spec.hf_adapter.args_to_hf(native.args)
    cls, _ = _REAL[name]
    fields = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cls(**fields))
    assert sum(p.numel() for p in native.parameters()) == sum(p.numel() for p in hf.parameters())
    assert spec.hf_adapter.args_from_hf(hf_config) == native.args


def test_published_moe_sizes_match_their_transformers_configs() -> None:
    """35b_a3b is transformers' Qwen3_5MoeTextConfig default, 80b_a3b its Qwen3NextConfig one
    (the checkpoints their docs name); 397b_a17b the model card's shape."""
    for name, (cls, overrides) in _REAL.items():
        family, flavor = name.split("/")
        args = build_model(family, flavor).args
        config = cls(**overrides)
        assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.head_dim) == (
            config.hidden_size,
            config.num_hidden_layers,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        ), name
        assert (args.linear_n_k_heads, args.linear_n_v_heads) == (
            config.linear_num_key_heads,
            config.linear_num_value_heads,
        ), name
        assert args.vocab_size == config.vocab_size, name
        assert list(args.layer_types) == config.layer_types, name


def test_sp_degree_must_divide_linear_attention_heads() -> None:
    check_linear_attention_heads(16, 32, 4)
    with pytest.raises(
        ConfigError, match=r"parallelism.sp \(3\).*key heads \(16\).*value heads \(32\)"
    ):
        check_linear_attention_heads(16, 32, 3)
    with pytest.raises(ConfigError, match=r"key heads \(2\)"):
        check_linear_attention_heads(2, 4, 4)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_lora_default_targets_adapt_the_linear_attention_projections(family: str) -> None:
    """LoRA's default targets take Gated DeltaNet's projections (and the gated attention's and
    the MLPs'); after a step on the adapters, merging gives the adapted forward."""
    from temper.config import LoRA

    torch.manual_seed(0)
    model = build_model(family, "debug")
    targets = LoRA().target_modules
    names = apply_lora(model, targets, rank=4, alpha=8.0)
    model = materialize(model, "cpu")
    init_lora(model)
    projections = {"wqkvz", "wba", "wo"} if family == "qwen3_next" else {"wqkv", "wz", "wb", "wa"}
    assert {f"layers.0.attention.{p}" for p in projections} <= set(names)
    ids = torch.randint(0, 2048, (2, 12))
    model(ids).logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == ("lora_" in name), name
    with torch.no_grad():
        for module in lora_modules(model):
            module.lora_b.normal_(0.0, 0.05)
        adapted = model(ids)
        torch.testing.assert_close(merge_lora(model)(ids), adapted, rtol=1e-5, atol=1e-5)


def test_dispatcher_runs_the_reference_on_cpu() -> None:
    q, k, v, g, beta, state = (t.float() for t in _rule_inputs(1, 70, 2, 8, 4, 1.0))
    assert dispatch.implementation("gated_delta", torch.device("cpu"), "auto") == "reference"
    out, final = gated_delta_rule(q, k, v, g, beta, state)
    want, want_final = chunk_gated_delta_rule(q, k, v, g, beta, state)
    assert torch.equal(out, want) and torch.equal(final, want_final)


def test_triton_choice_without_fla_falls_back_with_a_notice(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gated_delta, "fla_installed", lambda: False)
    assert gated_delta._fla() is chunk_gated_delta_rule
    assert "flash-linear-attention" in capsys.readouterr().err


@pytest.mark.skipif(
    not (torch.cuda.is_available() and gated_delta.fla_installed()),
    reason="FLA's kernel runs on CUDA with the fla package installed",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_kernel_equals_the_reference_on_gpu(dtype: torch.dtype) -> None:
    """Values, final state and gradients of FLA's chunked kernel against the reference, on
    a partial last chunk with GVA-expanded heads (fp32: 1e-4; bf16: 2e-2 relative)."""
    inputs = [
        t.to("cuda", torch.float32 if t.dim() < 4 or i == 5 else dtype).requires_grad_()
        for i, t in enumerate(_rule_inputs(2, 200, 4, 64, 64, 1.0))
    ]
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    results = []
    for impl in ("reference", "triton"):
        for t in inputs:
            t.grad = None
        out, final = gated_delta_rule(*inputs, impl=impl)
        (out.float().sum() + final.sum()).backward()
        results.append((out.float(), final, [t.grad.float() for t in inputs[:5]]))
    (out, final, grads), (f_out, f_final, f_grads) = results
    torch.testing.assert_close(f_out, out, rtol=tol, atol=tol)
    torch.testing.assert_close(f_final, final, rtol=tol, atol=tol)
    for got, want in zip(f_grads, grads, strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_config_refuses_sp_that_splits_no_whole_linear_attention_heads() -> None:
    from temper.recipes.qwen3_5 import qwen3_5_moe_debug

    config = qwen3_5_moe_debug()  # 4 heads on 2 kv heads; Gated DeltaNet 2 key, 4 value heads
    config.parallelism.sp = 2
    config.validate(world_size=2)
    config.parallelism.sp = 4  # attention replicates its 2 kv heads; Gated DeltaNet cannot
    with pytest.raises(ConfigError, match=r"sp \(4\).*key heads \(2\) and value heads \(4\)"):
        config.validate(world_size=4)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_loss_and_gradients(mode: str) -> None:
    """Recomputing Gated DeltaNet blocks (packed documents, MoE) in backward gives the same
    loss and gradients as storing everything."""
    from temper.objectives import CausalLM
    from temper.parallel.activation_checkpoint import apply_activation_checkpointing

    def loss_and_grads(checkpointed: bool) -> tuple[float, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = build_model("qwen3_5_moe", "debug", device="cpu", vocab_size=64)
        if checkpointed:
            apply_activation_checkpointing(model.layers, mode)
        ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
        positions = torch.cat([torch.arange(8), torch.arange(12)]).expand(2, 20)
        batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "position_ids": positions}
        loss, _, _ = CausalLM().loss(model, batch)
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters()}

    loss, grads = loss_and_grads(False)
    ac_loss, ac_grads = loss_and_grads(True)
    assert ac_loss == pytest.approx(loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(ac_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_autocast_trains_with_fp32_gradients_close_to_fp32() -> None:
    """Under bf16 autocast (how GPU runs train) the hybrid's loss stays within bf16's reach
    of fp32's and every gradient is fp32 and finite: the delta rule runs in fp32 inside."""
    torch.manual_seed(0)
    model = build_model("qwen3_5_moe", "debug", device="cpu", vocab_size=64)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    full = F.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    assert loss.item() == pytest.approx(full.item(), rel=2e-2)
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), name
    assert model.layers[0].attention.A_log.grad.abs().sum() > 0
