"""FP8 for the routed experts' grouped GEMMs: the conversion picks exactly the GroupedExperts,
the padding the FP8 kernel needs leaves the grouped GEMM's result unchanged, and a CPU run is
refused by name. torchao's FP8 grouped GEMM itself runs on CUDA sm90+ only, so its numerics
are not checked here."""

from __future__ import annotations

import copy

import pytest
import torch

from temper.config import ConfigError
from temper.kernels.grouped_gemm import grouped_mm_reference
from temper.models import build_model
from temper.models.layers.experts import GroupedExperts
from temper.quantize.float8_experts import (
    GROUP_ALIGN,
    Float8GroupedExperts,
    apply_float8_experts,
    padded_grouped_mm,
)
from temper.quantize.prepare import prepare_model
from temper.recipes.llama3 import llama3_debug

HAS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def test_padding_the_groups_keeps_the_grouped_gemm() -> None:
    gen = torch.Generator().manual_seed(0)
    sizes = torch.tensor([5, 0, 17, 32, 3])  # an empty group, one already aligned
    offsets = sizes.cumsum(0).to(torch.int32)
    x = torch.randn(int(sizes.sum()), 32, generator=gen, requires_grad=True)
    w = torch.randn(len(sizes), 32, 48, generator=gen, requires_grad=True)
    seen = []

    def spy(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        seen.append(torch.diff(offs, prepend=offs.new_zeros(1)))
        return grouped_mm_reference(a, b, offs)

    out = padded_grouped_mm(x, w, offsets, spy)
    expected = grouped_mm_reference(x, w, offsets)
    # Equal up to fp32 summation order (a padded group is a taller matmul).
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert seen[0].tolist() == [16, 0, 32, 32, 16]  # each group rounded up to a multiple of 16
    assert all(size % GROUP_ALIGN == 0 for size in seen[0].tolist())
    grads = torch.autograd.grad(out.square().sum(), (x, w))
    expected_grads = torch.autograd.grad(expected.square().sum(), (x, w))
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_conversion_picks_exactly_the_routed_experts(monkeypatch) -> None:
    torch.manual_seed(0)
    model = build_model("qwen3_moe", "debug", overrides={"n_layers": 2})  # layer 1 is MoE
    model.to_empty(device="cpu")
    model.init_weights()
    reference = copy.deepcopy(model)
    experts = sorted(n for n, m in model.named_modules() if type(m) is GroupedExperts)
    names = apply_float8_experts(model)
    assert sorted(names) == experts and experts
    converted = sorted(n for n, m in model.named_modules() if type(m) is Float8GroupedExperts)
    assert converted == experts
    # The same parameters under the same names (checkpoints, HF export, FSDP2 see no change).
    assert model.state_dict().keys() == reference.state_dict().keys()
    assert {n for n, m in model.named_modules()} == {n for n, m in reference.named_modules()}
    # With the plain grouped GEMM in the FP8 kernel's place, the model computes what it did:
    # the weights' layout and the padding are right; only the kernel's rounding would differ.
    monkeypatch.setattr(Float8GroupedExperts, "gemm", staticmethod(grouped_mm_reference))
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(HAS_SM90, reason="this machine runs the FP8 grouped GEMM")
def test_fp8_experts_are_refused_without_an_sm90_gpu() -> None:
    config = llama3_debug()
    config.quantize.float8.moe_experts = True
    with pytest.raises(ConfigError, match=r"quantize.float8.moe_experts .*compute capability 9"):
        config.validate(1)


def test_a_model_without_routed_experts_is_refused() -> None:
    config = llama3_debug()
    config.quantize.float8.moe_experts = True
    with torch.device("meta"):
        model = build_model("llama3", "debug")
    with pytest.raises(ConfigError, match="quantize.float8.moe_experts: llama3 has no routed"):
        prepare_model(model, config)


@pytest.mark.skipif(not HAS_SM90, reason="torchao's FP8 grouped GEMM needs CUDA sm90+")
def test_fp8_experts_track_bf16_on_the_gpu() -> None:
    """On an H100/H200 (scripts/gpu_check.sh): the FP8 experts' output and gradients within
    FP8's own rounding (e4m3, rowwise scales: a few percent) of the bf16 experts'."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    plain = GroupedExperts(256, 512, 8).to(device)
    plain.init_weights(0.02, 0.02)
    fp8 = Float8GroupedExperts(256, 512, 8).to(device)
    fp8.load_state_dict(plain.state_dict())
    sizes = torch.tensor([40, 0, 7, 64, 33, 16, 1, 95], device=device)
    offsets = sizes.cumsum(0).to(torch.int32)
    x = torch.randn(int(sizes.sum()), 256, device=device, dtype=torch.bfloat16)
    outs, grads = [], []
    for module in (plain, fp8):
        with torch.autocast("cuda", torch.bfloat16):
            out = module(x, offsets)
        out.float().square().sum().backward()
        outs.append(out.float())
        grads.append(module.w1.grad.float())
    for got, want in ((outs[1], outs[0]), (grads[1], grads[0])):
        error = ((got - want).norm() / want.norm()).item()
        assert 0 < error < 0.1, error
