"""gpt-oss's flavors and pieces: sizes as transformers counts them, the sink and window
attention against the definition written out, flex against the sdpa reference."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, GptOssConfig

from temper.kernels.attention import DocumentMask, attention
from temper.models.gpt_oss import FLAVORS, GptOssTransformer
from temper.models.gpt_oss.hf import args_to_hf
from temper.models.layers.clamped_moe import ClampedSwiGLU

# Positions restarting at each packed document: 9 + 7 tokens, and 5 + 11.
POSITIONS = torch.tensor([[*range(9), *range(7)], [*range(5), *range(11)]])


@pytest.mark.parametrize(("flavor", "billions"), [("20b", 20.91), ("120b", 116.83)])
def test_flavor_sizes_equal_transformers(flavor: str, billions: float) -> None:
    config = args_to_hf(FLAVORS[flavor])
    hf_config = GptOssConfig(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config)
        native = GptOssTransformer(FLAVORS[flavor])
    n_hf = sum(p.numel() for p in hf.parameters())
    assert sum(p.numel() for p in native.parameters()) == n_hf
    assert n_hf / 1e9 == pytest.approx(billions, abs=0.01)  # the model cards' 21B and 117B


def _by_hand(q, k, v, docs, window, sinks):  # noqa: ANN001, ANN202
    """Each query's softmax over its visible keys and its head's sink, sink mass dropped."""
    b, s, h, d = q.shape
    out = torch.zeros_like(q)
    for i in range(b):
        for head in range(h):
            kv = head // (h // k.shape[2])
            for t in range(s):
                same_doc = [j for j in range(t + 1) if docs.doc_ids[i, j] == docs.doc_ids[i, t]]
                keys = [j for j in same_doc if window is None or t - j < window]
                logits = torch.stack([q[i, t, head] @ k[i, j, kv] * d**-0.5 for j in keys])
                p = torch.cat([logits, sinks[head : head + 1]]).softmax(0)[:-1]
                out[i, t, head] = sum(pj * v[i, j, kv] for pj, j in zip(p, keys, strict=True))
    return out


def _qkv(requires_grad: bool = False, head_dim: int = 8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 16, n, head_dim, generator=g) for n in (4, 2, 2))
    sinks = torch.randn(4, generator=g)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v, sinks))


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_sinks_and_window_on_sdpa_equal_the_definition(window: int | None, packed: bool) -> None:
    q, k, v, sinks = _qkv()
    docs = DocumentMask.from_position_ids(POSITIONS if packed else torch.arange(16).expand(2, 16))
    got = attention(q, k, v, docs if packed else None, backend="sdpa", window=window, sinks=sinks)
    expected = _by_hand(q, k, v, docs, window, sinks)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_flex_forward_equals_sdpa_with_sinks_and_window(window: int | None, packed: bool) -> None:
    """FlexAttention runs forward on CPU: its window mask and lse-based sinks against sdpa's."""
    q, k, v, sinks = _qkv()
    docs = DocumentMask.from_position_ids(POSITIONS) if packed else None
    expected = attention(q, k, v, docs, backend="sdpa", window=window, sinks=sinks)
    prebuilt = None if docs is None else docs.with_block_mask(window)
    for mask in (docs, prebuilt):
        got = attention(q, k, v, mask, backend="flex", window=window, sinks=sinks)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_window_without_sinks_matches_the_definition() -> None:
    q, k, v, _ = _qkv()
    docs = DocumentMask.from_position_ids(POSITIONS)
    got = attention(q, k, v, docs, backend="sdpa", window=3)
    no_sink = torch.full((4,), -torch.inf)
    torch.testing.assert_close(got, _by_hand(q, k, v, docs, 3, no_sink), rtol=1e-5, atol=1e-6)


def test_sinks_get_the_gradient_of_the_definition() -> None:
    q, k, v, sinks = _qkv(requires_grad=True)
    docs = DocumentMask.from_position_ids(POSITIONS)
    weights = torch.randn(2, 16, 4, 8, generator=torch.Generator().manual_seed(1))
    grads = []
    for fn in (
        lambda: attention(q, k, v, docs, backend="sdpa", window=4, sinks=sinks),
        lambda: _by_hand(q, k, v, docs, 4, sinks),
    ):
        (fn() * weights).sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v, sinks)])
        for t in (q, k, v, sinks):
            t.grad = None
    for got, expected in zip(*grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_varlen_refuses_sinks() -> None:
    q, k, v, sinks = _qkv()
    with pytest.raises(RuntimeError, match="varlen.*no attention sinks.*flex"):
        attention(q, k, v, backend="varlen", sinks=sinks)


def test_clamped_swiglu_by_hand() -> None:
    act = ClampedSwiGLU(alpha=2.0, limit=1.0)
    gate = torch.tensor([-3.0, 0.5, 4.0])
    up = torch.tensor([5.0, -0.25, -2.0])
    g = torch.tensor([-3.0, 0.5, 1.0])  # gate clamped above only
    u = torch.tensor([1.0, -0.25, -1.0])  # up clamped both ways
    torch.testing.assert_close(act(gate, up), (u + 1) * g * torch.sigmoid(2.0 * g))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex backward needs a CUDA GPU")
@pytest.mark.parametrize("head_dim", [8, 64])
@pytest.mark.parametrize("packed", [False, True])
def test_flex_trains_like_sdpa_with_sinks_and_window_on_cuda(packed: bool, head_dim: int) -> None:
    """On CUDA flex is what ``auto`` runs for sinks: output and every gradient (through its
    log-sum-exp for the sinks) against the sdpa reference, fp32; the compiled kernel at
    gpt-oss's head size, eager flex below inductor's 16."""
    q, k, v, sinks = (t.cuda().requires_grad_() for t in _qkv(head_dim=head_dim))
    docs = DocumentMask.from_position_ids(POSITIONS.cuda()) if packed else None
    weights = torch.randn(2, 16, 4, head_dim, device="cuda")
    results = []
    for backend in ("sdpa", "auto"):
        out = attention(q, k, v, docs, backend=backend, window=4, sinks=sinks)
        (out * weights).sum().backward()
        results.append([out.detach(), *(t.grad.clone() for t in (q, k, v, sinks))])
        for t in (q, k, v, sinks):
            t.grad = None
    names = ("output", "q.grad", "k.grad", "v.grad", "sinks.grad")
    errors = {n: (g - e).abs().max().item() for n, g, e in zip(names, *results[::-1], strict=True)}
    for name, got, expected in zip(names, results[1], results[0], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=f"{name}: {errors}")


def test_flops_count_sliding_layers_over_their_window() -> None:
    with torch.device("meta"):
        model = GptOssTransformer(FLAVORS["debug"])  # 4 layers, window 16, 8 heads of 32
    dense = 6.0 * model.active_params()
    assert model.flops_per_token(64) == dense + 12 * 8 * 32 * (16 + 64 + 16 + 64)
    assert model.flops_per_token(8) == dense + 12 * 8 * 32 * 8 * 4


@pytest.mark.parametrize("flavor", ["20b", "120b"])
def test_release_rope_equals_transformers(flavor: str) -> None:
    """YaRN at the release's settings (factor 32 over 4096, untruncated ramp, head_dim 64):
    the same inverse frequencies bit for bit, and the same attention factor on cos/sin."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from temper.models.layers.rope import rope_inv_freq

    args = FLAVORS[flavor]
    config = args_to_hf(args)
    hf_config = GptOssConfig(**{k: v for k, v in config.items() if k != "architectures"})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, None)
    assert torch.equal(rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling), inv_freq)
    assert args.rope_scale == attention_factor == pytest.approx(0.1 * math.log(32) + 1)
