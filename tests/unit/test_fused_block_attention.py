"""Ring attention's fused per-block kernel (``temper.utils.compat.fused_attention_forward`` and
``_backward``) against plain softmax attention: the output and log-sum-exp of a block, and,
given the whole row's output and log-sum-exp, each block's share of the gradients, which
summed over the blocks give autograd's. On CPU in fp32 (CI); on CUDA in bf16 (the GPU check
script), where the kernel is flash's."""

from __future__ import annotations

import pytest
import torch

from temper.utils.compat import (
    fused_attention_backward,
    fused_attention_forward,
    fused_attention_runs,
)

CASES = [
    pytest.param("cpu", torch.float32, 1e-5, id="cpu_fp32"),
    pytest.param(
        "cuda",
        torch.bfloat16,
        2e-2,
        id="cuda_bf16",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ),
]


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


@pytest.mark.parametrize(("device", "dtype", "tol"), CASES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "whole"])
def test_block_output_and_log_sum_exp(
    device: str, dtype: torch.dtype, tol: float, causal: bool
) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, 16, generator=g).to(device, dtype)
    k, v = (torch.randn(2, 2, 8, 16, generator=g).to(device, dtype) for _ in range(2))
    assert fused_attention_runs(q)
    out, lse = fused_attention_forward(q, k, v, causal, 0.3)
    scores = _scores(q, k, 0.3, causal)
    v_heads = v.float().repeat_interleave(2, dim=1)
    torch.testing.assert_close(out.float(), scores.softmax(-1) @ v_heads, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.float(), scores.logsumexp(-1), rtol=tol, atol=tol)


@pytest.mark.parametrize(("device", "dtype", "tol"), CASES)
def test_blocks_gradients_sum_to_the_whole_rows(
    device: str, dtype: torch.dtype, tol: float
) -> None:
    """Queries over 12 keys in two blocks (the first 4 keys whole, the last 8 causal against
    the 8 queries): each block's backward, fed the whole row's output and log-sum-exp, gives
    its keys' gradients and its share of dq."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 8, 16, generator=g).to(device, dtype)
    k, v = (torch.randn(2, 2, 12, 16, generator=g).to(device, dtype) for _ in range(2))
    grad = torch.randn(2, 4, 8, 16, generator=g).to(device, dtype)
    qq, kk, vv = (t.float().requires_grad_() for t in (q, k, v))
    scores = torch.cat(
        [_scores(qq, kk[:, :, :4], 0.3, False), _scores(qq, kk[:, :, 4:], 0.3, True)], -1
    )
    out = scores.softmax(-1) @ vv.repeat_interleave(2, dim=1)
    out.backward(grad.float())
    lse = scores.logsumexp(-1).detach()
    whole_out = out.detach().to(dtype)
    dq = torch.zeros_like(qq)
    dk, dv = torch.zeros_like(kk), torch.zeros_like(vv)
    for keys, causal in ((slice(0, 4), False), (slice(4, 12), True)):
        block = fused_attention_backward(
            grad, q, k[:, :, keys], v[:, :, keys], whole_out, lse, causal, 0.3
        )
        dq += block[0].float()
        dk[:, :, keys] += block[1].float()
        dv[:, :, keys] += block[2].float()
    for got, want in ((dq, qq.grad), (dk, kk.grad), (dv, vv.grad)):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
