"""Every fused op equals its plain-PyTorch reference, forward and gradients, on odd sizes; the
dispatcher picks and falls back as documented; the layers and the objective route through it.

``CASES`` is shared with test_kernels_triton.py, which runs the Triton forms on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from temper.kernels import dispatch
from temper.kernels.cross_entropy import (
    IGNORE_INDEX,
    linear_cross_entropy,
    linear_log_probs,
    linear_log_probs_reference,
)
from temper.kernels.dispatch import REFERENCE, Impl, Kernels, resolve_kernels
from temper.kernels.moe_permute import permute, unpermute
from temper.kernels.norm import rms_norm
from temper.kernels.rope import apply_rope
from temper.kernels.sparse_attention import gather_attention, selected_indices, sparse_attention
from temper.kernels.swiglu import swiglu, swiglu_linear
from temper.models.layers.rope import rope_cos_sin, rope_inv_freq
from temper.models.layers.sparse_attention import select_top_k

Inputs = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Case:
    """``run(inputs, impl)`` on the tensors ``make(device, dtype)`` returns (float ones get
    gradients); every output is compared with ``impl="reference"``."""

    name: str
    make: Callable[[torch.device, torch.dtype], Inputs]
    run: Callable[[Inputs, Impl], torch.Tensor | tuple[torch.Tensor, ...]]


def _randn(*shape: int, device: torch.device, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device, dtype).requires_grad_()


def _norm_inputs(*shape: int) -> Callable[[torch.device, torch.dtype], Inputs]:
    def make(device: torch.device, dtype: torch.dtype) -> Inputs:
        x = _randn(*shape, device=device, dtype=dtype, seed=0)
        weight = _randn(shape[-1], device=device, dtype=torch.float32, seed=1)
        return x, weight

    return make


def _swiglu_inputs(device: torch.device, dtype: torch.dtype) -> Inputs:
    return tuple(_randn(3, 7, 37, device=device, dtype=dtype, seed=s) for s in (0, 1))


def _swiglu_linear_inputs(device: torch.device, dtype: torch.dtype) -> Inputs:
    """A weight scaled as an initialisation would (std 1/sqrt(37)), so bf16's rounding of the
    product, which the Triton form does once and the reference twice, stays within tolerance
    after the sum over 37 terms."""
    weight = _randn(11, 37, device=device, dtype=dtype, seed=2).detach() / 37**0.5
    return *_swiglu_inputs(device, dtype), weight.requires_grad_()


def _rope_inputs(batch_cos: int) -> Callable[[torch.device, torch.dtype], Inputs]:
    def make(device: torch.device, dtype: torch.dtype) -> Inputs:
        x = _randn(2, 7, 3, 20, device=device, dtype=dtype, seed=0)
        positions = torch.arange(7)[None].expand(batch_cos, 7) + torch.arange(batch_cos)[:, None]
        cos, sin = rope_cos_sin(rope_inv_freq(20, 10000.0), positions)
        return x, cos.to(device), sin.to(device)

    return make


def _routing(n: int, k: int, experts: int) -> torch.Tensor:
    """The stable expert-sorted order of n tokens' top-k choices, as MoE.permute makes it."""
    gen = torch.Generator().manual_seed(3)
    choices = torch.rand(n, experts, generator=gen).topk(k, dim=-1).indices
    return choices.flatten().argsort(stable=True)


def _permute_inputs(device: torch.device, dtype: torch.dtype) -> Inputs:
    return _randn(11, 13, device=device, dtype=dtype, seed=0), _routing(11, 3, 5).to(device)


def _unpermute_inputs(device: torch.device, dtype: torch.dtype) -> Inputs:
    y = _randn(33, 13, device=device, dtype=dtype, seed=0)
    weights = _randn(11, 3, device=device, dtype=dtype, seed=1)
    return y, _routing(11, 3, 5).to(device), weights


def _ce_inputs(device: torch.device, dtype: torch.dtype) -> Inputs:
    hidden = _randn(37, 24, device=device, dtype=dtype, seed=0)
    weight = (torch.randn(101, 24, generator=torch.Generator().manual_seed(1)) * 0.2).to(
        device, dtype
    )
    labels = torch.randint(0, 101, (37,), generator=torch.Generator().manual_seed(2))
    labels[::3] = IGNORE_INDEX
    return hidden, weight.requires_grad_(), labels.to(device)


def _ce(inputs: Inputs, impl: Impl) -> tuple[torch.Tensor, torch.Tensor]:
    hidden, weight, labels = inputs
    if impl == "reference":
        return linear_log_probs_reference(hidden, weight, labels)
    return linear_log_probs(hidden, weight, labels, chunk_tokens=8, impl=impl)


def _ce_loss(inputs: Inputs, impl: Impl) -> torch.Tensor:
    """The training loss with z-loss; its gradients come from the fused forward."""
    hidden, weight, labels = inputs
    if impl == "reference":
        log_probs, lse = linear_log_probs_reference(hidden, weight, labels)
        return -log_probs.sum() + 1e-2 * lse[labels != IGNORE_INDEX].pow(2).sum()
    return linear_cross_entropy(hidden, weight, labels, 1e-2, chunk_tokens=8, impl=impl)[0]


def _sparse_inputs(device: torch.device, dtype: torch.dtype) -> Inputs:
    """q, k, v of two 11-token rows, the second packed as documents of 4 and 7 tokens, and
    each query's 5 best-scored keys of its document's prefix (all of them, with empty slots,
    where that prefix is shorter)."""
    q = _randn(2, 11, 3, 12, device=device, dtype=dtype, seed=0)
    k = _randn(2, 11, 3, 12, device=device, dtype=dtype, seed=1)
    v = _randn(2, 11, 3, 8, device=device, dtype=dtype, seed=2)
    docs = torch.tensor([[0] * 11, [0] * 4 + [1] * 7])
    visible = (docs[:, :, None] == docs[:, None, :]) & torch.ones(11, 11, dtype=torch.bool).tril()
    scores = torch.randn(2, 11, 11, generator=torch.Generator().manual_seed(3))
    return q, k, v, select_top_k(scores, visible, 5).to(device)


def _sparse(inputs: Inputs, impl: Impl) -> torch.Tensor:
    """Against the gather of the selected keys (the kernel's computation in plain PyTorch)."""
    q, k, v, selected = inputs
    if impl == "reference":
        return gather_attention(q, k, v, selected_indices(selected), 0.3)
    return sparse_attention(q, k, v, selected, 0.3, impl=impl)


CASES = [
    Case("rmsnorm", _norm_inputs(3, 7, 37), lambda t, impl: rms_norm(*t, 1e-6, impl=impl)),
    Case("qk_norm", _norm_inputs(2, 5, 3, 16), lambda t, impl: rms_norm(*t, 1e-5, impl=impl)),
    Case("swiglu", _swiglu_inputs, lambda t, impl: swiglu(*t, impl=impl)),
    Case("swiglu_linear", _swiglu_linear_inputs, lambda t, impl: swiglu_linear(*t, impl=impl)),
    Case("rope", _rope_inputs(1), lambda t, impl: apply_rope(*t, impl=impl)),
    Case("rope_per_row", _rope_inputs(2), lambda t, impl: apply_rope(*t, impl=impl)),
    Case("moe_permute", _permute_inputs, lambda t, impl: permute(t[0], t[1], 3, impl=impl)),
    Case("moe_unpermute", _unpermute_inputs, lambda t, impl: unpermute(*t, impl=impl)),
    Case("cross_entropy", _ce_inputs, _ce),
    Case("cross_entropy_loss", _ce_inputs, _ce_loss),
    Case("sparse_attention", _sparse_inputs, _sparse),
]


def check_against_reference(
    case: Case, impl: Impl, device: torch.device, dtype: torch.dtype, rtol: float, atol: float
) -> None:
    """Outputs and the gradients of every float input under random cotangents."""
    results = []
    for which in ("reference", impl):
        inputs = case.make(device, dtype)
        outs = case.run(inputs, which)
        outs = outs if isinstance(outs, tuple) else (outs,)
        gen = torch.Generator().manual_seed(4)
        cotangents = [torch.randn(o.shape, generator=gen).to(o) for o in outs]
        leaves = [t for t in inputs if t.requires_grad]
        grads = torch.autograd.grad(outs, leaves, cotangents)
        results.append([*outs, *grads])
    for got, expected in zip(results[1], results[0], strict=True):
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_compiled_form_equals_reference(case: Case) -> None:
    check_against_reference(
        case, "compile", torch.device("cpu"), torch.float32, rtol=1e-5, atol=1e-6
    )


def test_reference_unless_asked_and_auto_resolves_by_device() -> None:
    cpu = torch.device("cpu")
    assert dispatch.implementation("rmsnorm", cpu, None) == "reference"
    resolved = resolve_kernels(Kernels(), cpu)  # auto: Triton is CUDA's; CPU compiles if asked
    assert {getattr(resolved, op) for op in dispatch.OPS} == {"reference"}
    assert resolve_kernels(REFERENCE, cpu) == REFERENCE


def test_unavailable_choice_falls_back_with_one_notice(
    capsys: pytest.CaptureFixture[str],
) -> None:
    resolved = resolve_kernels(Kernels(swiglu="triton"), torch.device("cpu"))
    notice = capsys.readouterr().err.strip().splitlines()
    assert notice == [
        "temper: kernels.swiglu=triton cannot run (Triton kernels run on CUDA, this is cpu); "
        "using reference"
    ]
    assert resolved.swiglu == "reference"
    assert dispatch.implementation("swiglu", torch.device("cpu"), resolved.swiglu) == "reference"
    assert capsys.readouterr().err == ""


def test_kernels_config_rejects_unknown_choices() -> None:
    with pytest.raises(ValueError, match="kernels.rope"):
        Kernels(rope="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cross_entropy_chunk"):
        Kernels(cross_entropy_chunk=-1)


def _tiny_moe() -> torch.nn.Module:
    """Qwen3-MoE with q/k norms, a dense and an MoE layer, tied embeddings: every fused op."""
    from temper.models.qwen3_moe.args import Qwen3MoeArgs
    from temper.models.qwen3_moe.model import Qwen3MoeTransformer

    args = Qwen3MoeArgs(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=97,
        ffn_hidden_dim=48, tie_embeddings=True, n_experts=4, top_k=2, moe_hidden_dim=24,
        norm_topk_prob=True, mlp_only_layers=(0,),
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeTransformer(args)
    model.init_weights()
    return model


def _packed_batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 97, (2, 13), generator=gen)
    labels = torch.randint(0, 97, (2, 13), generator=gen)
    labels[:, ::4] = IGNORE_INDEX
    positions = torch.cat([torch.arange(6), torch.arange(7)])[None].expand(2, 13)
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def _loss_and_grads(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], kernels: Kernels = REFERENCE
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and gradients with ``kernels`` for the model's ops and the objective's."""
    from temper.objectives import CausalLM, CausalLMConfig

    model.zero_grad()
    model.use_kernels(kernels)
    objective = CausalLM(CausalLMConfig(z_loss_weight=1e-3), kernels)
    loss_sum, n_tokens, metrics = objective.loss(model, batch)
    (loss_sum / n_tokens).backward()
    assert metrics["z_loss"] > 0
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss_sum.detach(), grads


def test_layers_and_objective_route_through_the_dispatcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Forcing ``compile`` reaches every op's reference through ``compiled`` (here recording,
    not compiling), the objective takes the fused loss, and loss and gradients stay put. The
    SwiGLU runs twice per forward: with its down projection in the dense layer's MLP, and alone
    in the routed experts (through the expert dispatcher)."""
    calls: list[str] = []

    def record(fn: Callable[..., object]) -> Callable[..., object]:
        calls.append(fn.__name__)
        return fn

    monkeypatch.setattr(dispatch, "compiled", record)
    model, batch = _tiny_moe(), _packed_batch()
    plain_loss, plain_grads = _loss_and_grads(model, batch)
    assert calls == []
    forced = dict.fromkeys(dispatch.OPS, "compile")
    fused_loss, fused_grads = _loss_and_grads(
        model, batch, Kernels(cross_entropy_chunk=7, **forced)
    )
    assert calls.count("swiglu_reference") == calls.count("swiglu_linear_reference") == 1
    assert set(calls) == {
        "rms_norm_reference",
        "swiglu_reference",
        "swiglu_linear_reference",
        "apply_rope_reference",
        "permute_reference",
        "unpermute_reference",
        "log_probs_from_logits",
        "loss_and_grad_reference",
    }
    assert abs(fused_loss - plain_loss) <= 1e-5 * abs(plain_loss)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_fused_loss_on_sequence_shards_sums_to_the_whole() -> None:
    """Tokens are independent, so sequence-parallel shards need no special handling."""
    hidden, weight, labels = _ce_inputs(torch.device("cpu"), torch.float32)
    whole, _ = linear_log_probs(hidden, weight, labels, chunk_tokens=5)
    pieces = zip(hidden.split(19), labels.split(19), strict=True)
    shards = [linear_log_probs(h, weight, y, 5)[0] for h, y in pieces]
    torch.testing.assert_close(torch.cat(shards), whole, rtol=0, atol=0)


@pytest.mark.parametrize("z_loss_weight", [0.0, 1e-2])
def test_fused_loss_equals_plain_loss_within_1e5(z_loss_weight: float) -> None:
    """The training loss: masked labels, odd sizes, z-loss; gradients computed in its forward."""
    hidden, weight, labels = _ce_inputs(torch.device("cpu"), torch.float32)
    valid = labels != IGNORE_INDEX
    log_probs, lse = linear_log_probs_reference(hidden, weight, labels)
    z_sum = lse[valid].pow(2).sum()
    plain = -log_probs.sum() + z_loss_weight * z_sum
    plain_grads = torch.autograd.grad(plain * 0.3, (hidden, weight))
    fused, fused_z = linear_cross_entropy(hidden, weight, labels, z_loss_weight, 8)
    fused_grads = torch.autograd.grad(fused * 0.3, (hidden, weight))
    assert abs(fused.item() - plain.item()) <= 1e-5 * abs(plain.item())
    torch.testing.assert_close(fused_z, z_sum.detach(), rtol=1e-6, atol=0)
    for got, expected in zip(fused_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_head_with_adapters_keeps_full_logits() -> None:
    """The fused loss reads only ``output.weight``; a LoRA head must go through its forward."""
    from temper.models.lora import apply_lora

    model, batch = _tiny_moe(), _packed_batch()
    model.output.weight = torch.nn.Parameter(model.output.weight.detach().clone())  # untie
    apply_lora(model, ["output"], rank=2, alpha=4.0)
    for lora in (model.output.lora_a, model.output.lora_b):
        torch.nn.init.normal_(lora, std=0.5)
    plain_loss, _ = _loss_and_grads(model, batch)
    fused_loss, _ = _loss_and_grads(model, batch, Kernels())
    assert abs(fused_loss - plain_loss) <= 1e-5 * abs(plain_loss)
