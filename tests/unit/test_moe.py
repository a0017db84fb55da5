import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeTopKRouter,
    load_balancing_loss_func,
)

from temper.kernels.grouped_gemm import grouped_mm_fast
from temper.kernels.moe_permute import unpermute
from temper.models.layers import experts as experts_module
from temper.models.layers.experts import GroupedExperts, permute, run_local
from temper.models.layers.moe import (
    MoE,
    RoutingStats,
    keep_routing,
    load_balancing_loss,
    load_imbalance,
)
from temper.models.layers.routers import GroupLimitedRouting, TopKRouter, update_expert_bias

DIM, HIDDEN, EXPERTS = 16, 12, 6


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_matches_transformers(norm_topk_prob: bool) -> None:
    config = Qwen3MoeConfig(
        hidden_size=DIM, num_experts=EXPERTS, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob
    )
    torch.manual_seed(0)
    theirs = Qwen3MoeTopKRouter(config)
    ours = TopKRouter(DIM, EXPERTS, top_k=3, norm_topk_prob=norm_topk_prob)
    with torch.no_grad():
        theirs.weight.normal_()
        ours.gate.weight.copy_(theirs.weight)
    x = torch.randn(40, DIM)
    probs, weights, experts = ours(x)
    logits, expected_weights, expected_experts = theirs(x)
    assert torch.equal(experts, expected_experts)
    torch.testing.assert_close(weights, expected_weights, rtol=0, atol=0)
    torch.testing.assert_close(probs, logits.softmax(-1), rtol=1e-6, atol=1e-7)
    sums = weights.sum(-1)
    assert torch.allclose(sums, torch.ones(40)) == norm_topk_prob


def _moe(top_k: int = 2) -> MoE:
    torch.manual_seed(0)
    moe = MoE(DIM, HIDDEN, EXPERTS, top_k, norm_topk_prob=False).double()
    moe.init_weights(std=0.5, out_std=0.5)
    return moe


def test_moe_equals_a_loop_over_tokens_forward_and_backward() -> None:
    moe = _moe(top_k=3)
    x = torch.randn(2, 9, DIM, dtype=torch.float64, requires_grad=True)
    out, _ = moe(x)

    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    probs = (x @ moe.router.gate.weight.T).softmax(-1, dtype=torch.float32)  # fp32, as HF
    expected = torch.zeros_like(x)
    for b in range(2):
        for t in range(9):
            top = probs[b, t].topk(3)
            for p, e in zip(top.values, top.indices.tolist(), strict=True):
                h = torch.nn.functional.silu(w1[e] @ x[b, t]) * (w3[e] @ x[b, t])
                expected[b, t] += p.double() * (w2[e] @ h)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)

    params = [x, *moe.parameters()]
    cotangent = torch.randn_like(out)
    got_grads = torch.autograd.grad(out, params, cotangent)
    expected_grads = torch.autograd.grad(expected, params, cotangent)
    for got, want in zip(got_grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_permute_groups_rows_by_expert_and_counts_them() -> None:
    x = torch.arange(5.0)[:, None]
    experts = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2], [1, 0]])
    rows, order, counts = permute(x, experts, n_experts=4)
    assert counts.tolist() == [4, 3, 3, 0]
    # Expert 0 gets tokens 0, 1, 3, 4 in token order; then expert 1: 1, 2, 4; expert 2: 0, 2, 3.
    assert rows.flatten().tolist() == [0, 1, 3, 4, 1, 2, 4, 0, 2, 3]
    assert torch.equal(experts.flatten()[order], torch.tensor([0] * 4 + [1] * 3 + [2] * 3))


@pytest.mark.parametrize("kernel", ["dispatcher", "torch._grouped_mm"])
def test_permute_grouped_gemm_unpermute_equal_a_loop_over_experts_with_empty_ones(
    kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random routing that never picks experts 0, 3 and 7 (first, middle, last): the grouped
    path's output and every gradient equal a per-expert loop, and the idle experts' weights get
    exactly zero gradient (a grouped kernel could leave their rows unwritten)."""
    n, n_experts, top_k, empty = 40, 8, 2, [0, 3, 7]
    dtype = torch.float64
    if kernel == "torch._grouped_mm":
        if not hasattr(torch, "_grouped_mm"):
            pytest.skip("no torch._grouped_mm")
        monkeypatch.setattr(experts_module, "grouped_mm", grouped_mm_fast)
        dtype = torch.float32  # its CPU kernel's dtypes
    gen = torch.Generator().manual_seed(0)
    used = torch.tensor([e for e in range(n_experts) if e not in empty])
    experts = used[torch.rand(n, len(used), generator=gen).argsort(-1)[:, :top_k]]
    weights = torch.rand(n, top_k, generator=gen, dtype=dtype).requires_grad_()
    x = torch.randn(n, DIM, generator=gen, dtype=dtype).requires_grad_()
    torch.manual_seed(0)
    grouped = GroupedExperts(DIM, HIDDEN, n_experts).to(dtype)
    grouped.init_weights(std=0.5, out_std=0.5)

    rows, order, counts = permute(x, experts, n_experts)
    assert counts[empty].tolist() == [0, 0, 0] and bool((counts[used] > 0).all())
    out = unpermute(run_local(grouped, rows, counts), order, weights)

    w1, w2, w3 = grouped.w1, grouped.w2, grouped.w3
    expected = torch.zeros_like(x)
    for e in range(n_experts):
        token, slot = (experts == e).nonzero(as_tuple=True)
        h = torch.nn.functional.silu(x[token] @ w1[e].T) * (x[token] @ w3[e].T)
        expected = expected.index_add(0, token, weights[token, slot, None] * (h @ w2[e].T))
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(out, expected, **tol)

    params = [x, weights, w1, w2, w3]
    cotangent = torch.randn_like(out)
    got_grads = torch.autograd.grad(out, params, cotangent)
    for got, want in zip(got_grads, torch.autograd.grad(expected, params, cotangent), strict=True):
        torch.testing.assert_close(got, want, **tol)
    for grad in got_grads[2:]:
        assert bool((grad[empty] == 0).all()) and bool((grad[used] != 0).any())


def test_expert_bias_moves_a_skewed_router_toward_balance() -> None:
    """DeepSeek V3's aux-loss-free balancing on a router that sends most tokens to experts 0-2:
    after training forwards and bias updates the same tokens spread far more evenly, and only
    the overloaded experts' biases went down."""
    n_experts, top_k = 16, 4
    torch.manual_seed(0)
    routing = GroupLimitedRouting(n_groups=4, topk_group=2, scaling_factor=1.0)
    moe = MoE(DIM, HIDDEN, n_experts, top_k, norm_topk_prob=True, group_limited=routing)
    moe.init_weights(std=0.5, out_std=0.5)
    with torch.no_grad():  # every token carries feature 0, which experts 0-2 weigh highly
        moe.router.gate.weight[:, 0] = 0.0
        moe.router.gate.weight[:3, 0] = 3.0
    x = torch.randn(256, DIM)
    x[:, 0] = 1.0

    def imbalance() -> float:
        with torch.no_grad():  # not a training step: the router does not count it
            _, stats = moe(x)
            keep_routing([], moe, stats)
        return load_imbalance([stats]).item()

    before = imbalance()
    assert before > 3.0  # of at most n_experts / top_k = 4
    for _ in range(20):
        _, stats = moe(x)
        keep_routing([], moe, stats)  # as a decoder does; a training forward: counts the load
        update_expert_bias([moe.router], rate=0.02)
    after = imbalance()
    assert after < 0.5 * before, (before, after)
    bias = moe.router.expert_bias
    assert bool((bias[:3] < 0).all()) and bool((bias[3:] > 0).all()), bias


def test_moe_records_routing_stats() -> None:
    moe = _moe()
    x = torch.randn(3, 5, DIM, dtype=torch.float64)
    _, stats = moe(x)
    probs, _, experts = moe.router(x.reshape(15, DIM))
    assert stats.n_tokens == 15
    assert torch.equal(stats.tokens_per_expert, experts.flatten().bincount(minlength=EXPERTS))
    torch.testing.assert_close(stats.prob_sum, probs.sum(0))


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_load_balancing_loss_equals_transformers(top_k: int) -> None:
    torch.manual_seed(0)
    # Three layers with different skews, so pooling across layers differs from a per-layer mean.
    logits = [torch.randn(30, EXPERTS) * s + b for s, b in ((1, 0), (3, 0), (2, 1))]
    logits = [(lg + torch.arange(EXPERTS) * i).requires_grad_() for i, lg in enumerate(logits)]
    stats = []
    for lg in logits:
        probs = lg.softmax(-1)
        experts = probs.topk(top_k, dim=-1).indices.flatten()
        counts = torch.zeros(EXPERTS, dtype=torch.int64).scatter_add_(
            0, experts, torch.ones_like(experts)
        )
        stats.append(RoutingStats(counts, probs.sum(0), lg.shape[0]))
    ours = load_balancing_loss(stats)
    theirs = load_balancing_loss_func(tuple(logits), EXPERTS, top_k)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    got = torch.autograd.grad(ours, logits)
    expected = torch.autograd.grad(theirs, logits)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-8)


def test_load_imbalance_by_hand() -> None:
    stats = [
        RoutingStats(torch.tensor([4, 0, 2, 2]), torch.zeros(4), 4),  # max 4 / mean 2
        RoutingStats(torch.tensor([2, 2, 2, 2]), torch.zeros(4), 4),  # balanced: 1
    ]
    assert load_imbalance(stats).item() == pytest.approx(1.5)


class _MoEBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = MoE(16, 8, n_experts=4, top_k=2, norm_topk_prob=True)
        self.moe.init_weights(0.5, 0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RoutingStats]:
        return self.moe(x)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_block_returns_its_forwards_routing(mode) -> None:
    """A checkpointed block's statistics are its forward's outputs, the unchecked block's, and
    the balancing loss's gradient reaches the router through the recomputation."""
    from temper.parallel.activation_checkpoint import apply_activation_checkpointing

    torch.manual_seed(0)
    plain, checked = _MoEBlock(), _MoEBlock()
    checked.load_state_dict(plain.state_dict())
    apply_activation_checkpointing([checked], mode)
    x = torch.randn(2, 5, 16)
    results = []
    for block in (plain, checked):
        out, stats = block(x)
        (out.sum() + load_balancing_loss([stats])).backward()
        results.append((stats, block.moe.router.gate.weight.grad))
    (want, want_grad), (got, got_grad) = results
    assert torch.equal(got.tokens_per_expert, want.tokens_per_expert)
    torch.testing.assert_close(got.prob_sum, want.prob_sum, rtol=0, atol=0)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["none", "full"])
def test_each_decoder_forward_has_its_own_routing(mode) -> None:
    """A MoE decoder collects its layers' statistics at each forward: after a second forward
    on other tokens they are that forward's (a fresh copy's on those tokens alone), and its
    backward's recomputation leaves them as they were."""
    import copy

    from temper.models import build_model, materialize
    from temper.parallel.activation_checkpoint import apply_activation_checkpointing

    torch.manual_seed(0)
    model = materialize(build_model("qwen3_moe", "debug"), torch.device("cpu"))
    fresh = copy.deepcopy(model)
    apply_activation_checkpointing(model.layers, mode)
    first, second = torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 12))
    model(first)
    out = model(second)
    written = list(model.routing())
    fresh(second)
    want = fresh.routing()
    (out.square().mean() + model.aux_loss()).backward()
    after = model.routing()
    assert all(a is w for a, w in zip(after, written, strict=True))
    for got, ref in zip(written, want, strict=True):
        assert torch.equal(got.tokens_per_expert, ref.tokens_per_expert)
        torch.testing.assert_close(got.prob_sum, ref.prob_sum, rtol=0, atol=0)
        assert got.n_tokens == ref.n_tokens == 24


def test_selective_checkpointing_with_a_cold_grouped_gemm_probe() -> None:
    """The first grouped GEMM of a process asks once whether the CPU kernel exists; asked
    inside a selectively checkpointed block, the probe counted as one of the block's saved
    grouped GEMMs, so the recomputation took each saved output for the one before it (a
    shape error on CPU). Gradients equal the unchecked block's."""
    from temper.kernels import grouped_gemm
    from temper.parallel.activation_checkpoint import apply_activation_checkpointing

    torch.manual_seed(0)
    plain, checked = _MoEBlock(), _MoEBlock()
    checked.load_state_dict(plain.state_dict())
    apply_activation_checkpointing([checked], "selective")
    x = torch.randn(2, 8, 16)
    grads = []
    for block in (plain, checked):
        grouped_gemm._cpu_kernel_exists.cache_clear()
        block(x)[0].square().sum().backward()
        grads.append([p.grad for p in block.parameters()])
    for want, got in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
