"""Context parallelism: the load-balanced layout and ring attention (gloo ranks, CPU, fp32).

Ring attention at CP 2 and CP 4 gives one process's attention (``attention(..., "sdpa")`` on
the whole sequence) and its q, k, v and sink gradients within 1e-5, on packed rows whose
documents cross the chunk boundaries and end in padding, with GQA, sinks, a sliding window
and MLA's head sizes (v narrower than q/k, its own scale), with the fused kernel (per
document where a block holds document boundaries) and without. Gated DeltaNet at CP 2 and CP 4, its
state and convolution window passed along the chunks, gives one process's output and
gradients alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from harness import run_on_ranks
from training import (
    SINGLE,
    STEPS,
    Layout,
    assert_same_logits_loss_and_grads,
    assert_same_metrics,
    families_against_one_process,
    parity_config,
)
from training import train as train_layout

from temper.config import Config, ConfigError
from temper.data.batch import DOCUMENT_POSITIONS, SEQUENCE_SHARD
from temper.kernels.attention import DocumentMask, attention
from temper.parallel.context_parallel import shard_batch, unshard
from temper.parallel.ulysses import PAD_POSITION
from temper.recipes.llama3 import llama3_debug
from temper.recipes.qwen3 import qwen3_moe_debug
from temper.recipes.qwen3_5 import qwen3_5_debug

SEQ_LEN = 24
DOCUMENTS = ([5, 9, 3, 7], [11, 11])
"""Document lengths of the two rows; the second ends in two pads (each its own document)."""


@dataclass(frozen=True)
class Case:
    name: str
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    v_dim: int = 8
    packed: bool = True
    window: int | None = None
    sinks: bool = False
    scale: float | None = None
    documents: tuple[list[int], ...] = DOCUMENTS


CP2_CASES = (
    Case("gqa_documents"),
    Case("causal_rows", packed=False),
    Case("sinks_window", window=5, sinks=True),
    Case("mla", kv_heads=4, head_dim=12, v_dim=6, scale=0.3),
    Case("mla_rows_wide_window", kv_heads=4, head_dim=12, v_dim=6, packed=False, window=20),
    Case("one_boundary", documents=([6, 18],)),
    Case("sinks_rows", packed=False, sinks=True),
)
CP4_CASES = (
    Case("all", window=4, sinks=True, v_dim=6),
    Case("documents_sinks", sinks=True, v_dim=6),
)


def _positions(documents: tuple[list[int], ...] = DOCUMENTS) -> torch.Tensor:
    rows = []
    for lengths in documents:
        row = torch.cat([torch.arange(n) for n in lengths])
        rows.append(torch.cat([row, torch.full((SEQ_LEN - len(row),), PAD_POSITION)]))
    return torch.stack(rows)


def _inputs(case: Case) -> dict[str, torch.Tensor]:
    """The whole sequences' q, k, v, sinks and output gradient, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    b = len(case.documents)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return {
        "q": randn(b, SEQ_LEN, case.heads, case.head_dim),
        "k": randn(b, SEQ_LEN, case.kv_heads, case.head_dim),
        "v": randn(b, SEQ_LEN, case.kv_heads, case.v_dim),
        "sinks": randn(case.heads),
        "grad": randn(b, SEQ_LEN, case.heads, case.v_dim),
    }


def _docs(case: Case) -> DocumentMask | None:
    return DocumentMask.from_position_ids(_positions(case.documents)) if case.packed else None


def _ring_rank(
    cases: tuple[Case, ...], tile_scores: int, fused: bool
) -> list[dict[str, torch.Tensor]]:
    """Each case's local output and gradients on this rank, and how many blocks ran the fused
    kernel (forward and backward); ``same_in_series``: without overlap, the same numbers."""
    import torch.distributed as dist

    from temper.kernels import ring_attention as ring_module
    from temper.kernels.ring_attention import load_balanced_indices, ring_attention
    from temper.parallel.context_parallel import gather_sequence

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    columns = load_balanced_indices(SEQ_LEN, rank, size)
    calls = []
    for name in ("fused_attention_forward", "fused_attention_backward"):
        kernel = getattr(ring_module, name)

        def counted(*args: object, kernel: Callable = kernel) -> object:
            calls.append(1)
            return kernel(*args)

        setattr(ring_module, name, counted)
    results = []
    for case in cases:
        inputs = _inputs(case)
        runs = []
        for overlap in (True, False):
            q, k, v = (inputs[n][:, columns].requires_grad_() for n in ("q", "k", "v"))
            sinks = inputs["sinks"].clone().requires_grad_() if case.sinks else None
            group = dist.group.WORLD
            calls.clear()
            out = ring_attention(
                q,
                k,
                v,
                _docs(case),
                group,
                scale=case.scale,
                window=case.window,
                sinks=sinks,
                fused=fused,
                overlap=overlap,
                tile_scores=tile_scores,
            )
            (out * inputs["grad"][:, columns]).sum().backward()
            result = {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
            if sinks is not None:
                result["sinks"] = sinks.grad
            result["fused_calls"] = torch.tensor(len(calls))
            runs.append(result)
        result, in_series = runs
        result["same_in_series"] = all(torch.equal(t, in_series[n]) for n, t in result.items())
        result["gathered"] = gather_sequence(result["out"], dist.group.WORLD)
        results.append(result)
    return results


def _reference(case: Case) -> dict[str, torch.Tensor]:
    inputs = _inputs(case)
    q, k, v = (inputs[n].requires_grad_() for n in ("q", "k", "v"))
    sinks = inputs["sinks"].requires_grad_() if case.sinks else None
    out = attention(
        q,
        k,
        v,
        _docs(case),
        backend="sdpa",
        scale=case.scale,
        window=case.window,
        sinks=sinks,
    )
    (out * inputs["grad"]).sum().backward()
    result = {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
    if sinks is not None:
        result["sinks"] = sinks.grad
    return result


FUSED_CALLS = {
    "gqa_documents": [18, 14],
    "causal_rows": [4, 4],
    "mla": [18, 14],
    "mla_rows_wide_window": [2, 4],
    "one_boundary": [6, 2],
    "sinks_rows": [4, 4],
    "documents_sinks": [22, 20, 20, 18],
}
"""Fused kernel calls per rank (forward + backward, so twice the forward's), by hand from the
layout; other cases make none. CP 2: rank 0 holds columns 0-5 and 18-23, rank 1 6-17; its
own block is causal over all 12, its rectangle of the other's keys is 18-23 over 6-17 on
rank 0 and 6-17 over 0-5 on rank 1. Continuous rows: one call per block, with sinks too
(added after the merge). A window of 20: rank 0's own block spans 23 columns (cut), its
rectangle spans 17 (whole), rank 1's two 11 and 17. A block with document boundaries runs
one call per row and document in both its queries and its keys. DOCUMENTS (row 0: 0-4,
5-13, 14-16, 17-23; row 1: 0-10, 11-21, 22, 23): rank 0's own block 2 + 4, its rectangle
1 + 1 (documents 3 and 1); rank 1's own 3 + 2, its rectangle 1 + 1 (documents 1 and 0): 9
and 7. One boundary (0-5, 6-23): rank 0's own block 2 (both documents), its rectangle one
document; rank 1's own block one document, its rectangle none in common: 3 and 1. CP 4
(chunks of 3; rank r holds chunks r and 7 - r), DOCUMENTS, per source rank 0-3 (row 0 +
row 1): rank 0: 2+4, 1+1, 1+1, 0+1 = 11; rank 1: 1+1, 3+2, 1+1, 0+1 = 10; rank 2: 0+1,
1+1, 3+2, 1+1 = 10; rank 3: 0+1, 1+1, 1+1, 2+2 = 9. CP 2's other packed case has a window
of 5 and CP 4's "all" a window of 4, which cut every block."""


@pytest.mark.parametrize(
    ("size", "cases", "tile_scores", "fused"),
    [
        (2, CP2_CASES, 5 * 2 * 4 * 12, True),
        (2, CP2_CASES, 5 * 2 * 4 * 12, False),
        (4, CP4_CASES, 2**24, True),
    ],
    ids=["cp2", "cp2_reference", "cp4"],
)
def test_ring_attention_matches_one_process(
    size: int, cases: tuple[Case, ...], tile_scores: int, fused: bool
) -> None:
    """Outputs and gradients of every case, each rank's tokens put back in global order, with
    the fused per-block kernel where a block allows it and with the reference for every
    block; at CP 2 a budget of 5 rows' scores (2 rows x 4 heads x 12 keys each) puts the
    reference's 12 local queries in tiles of 5 (5, 5, 2), at CP 4 the default budget takes
    them in one. Waiting for each transfer before the compute gives the same bits."""
    ranks = run_on_ranks(_ring_rank, size, cases, tile_scores, fused)
    for i, case in enumerate(cases):
        want = _reference(case)
        for name, expected in want.items():
            if name == "sinks":  # each rank's queries add their share of a sink's gradient
                got = sum(rank[i][name] for rank in ranks)
            else:
                got = unshard([rank[i][name] for rank in ranks])
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=case.name)
        for rank in ranks:
            torch.testing.assert_close(rank[i]["gathered"], want["out"], rtol=1e-5, atol=1e-5)
            assert rank[i]["same_in_series"], case.name
        calls = [int(rank[i]["fused_calls"]) for rank in ranks]
        assert calls == (FUSED_CALLS.get(case.name, [0] * size) if fused else [0] * size)


def _one_rank_ring(device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Ring attention in a CP group of one rank (no transfer: its own block alone) on packed
    rows, with sinks and v narrower than q: its output and gradients (on the host) and how
    many fused kernel calls ran."""
    import torch.distributed as dist

    from temper.kernels import ring_attention as ring_module

    dist.init_process_group("gloo")
    calls = []
    kernel = ring_module.fused_attention_forward

    def counted(*args: object) -> object:
        calls.append(1)
        return kernel(*args)

    ring_module.fused_attention_forward = counted
    inputs = {n: t.to(device, dtype) for n, t in _inputs(ONE_RANK).items()}
    q, k, v, sinks = (inputs[n].requires_grad_() for n in ("q", "k", "v", "sinks"))
    docs = DocumentMask.from_position_ids(_positions().to(device))
    out = ring_module.ring_attention(q, k, v, docs, dist.group.WORLD, sinks=sinks)
    (out * inputs["grad"]).sum().backward()
    result = {"out": out, "q": q.grad, "k": k.grad, "v": v.grad, "sinks": sinks.grad}
    result = {n: t.detach().float().cpu() for n, t in result.items()}
    result["fused_calls"] = torch.tensor(len(calls))
    return result


ONE_RANK = Case("one_rank", sinks=True, v_dim=6)


@pytest.mark.parametrize(
    ("device", "dtype", "tol"),
    [
        pytest.param("cpu", torch.float32, 1e-5, id="cpu_fp32"),
        pytest.param(
            "cuda",
            torch.bfloat16,
            3e-2,
            id="cuda_bf16",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ),
    ],
)
def test_ring_attention_runs_documents_fused_on_the_device(
    device: str, dtype: torch.dtype, tol: float
) -> None:
    """The fused kernel per document on ``device`` (on CUDA flash's branch, bf16; the GPU
    check script runs it): one rank's ring, its own block cut into the documents of
    DOCUMENTS' two rows (4 + 4 causal squares, forward calls counted), against one process's
    attention in fp32 on the CPU."""
    (got,) = run_on_ranks(_one_rank_ring, 1, device, dtype)
    assert int(got.pop("fused_calls")) == 8
    for name, expected in _reference(ONE_RANK).items():
        torch.testing.assert_close(got[name], expected, rtol=tol, atol=tol, msg=name)


def test_cp2_halves_each_ranks_activation_peak(tmp_path: Path) -> None:
    """Llama 3 debug, one continuous row of 4096 tokens, one training step: the busiest CP 2
    rank's live-tensor peak (``bench.context_parallel``'s count, over the tensors alive
    before the step) is about half of one process's. Measured 0.57x (0.211 against 0.368
    GiB); the allowance up to 0.62x is for what does not shrink with cp, about 0.02-0.04 GiB
    here: the loss chunk's logits, the weights' gradients as FSDP gathers and reduces them,
    the K/V blocks in flight. A rank that held the whole sequence's activations would show
    about 1x."""
    from bench.context_parallel import measure_rank

    peaks = []
    for cp in (1, 2):
        ranks = run_on_ranks(measure_rank, cp, "llama3_debug", 4096, cp, 1, str(tmp_path), [])
        peaks.append(max(peak for peak, _, _ in ranks))
    assert 0.45 < peaks[1] / peaks[0] < 0.62, peaks


GDN_DOCUMENTS = (*DOCUMENTS, [6, 6, 1, 8, 3])
"""The third row's documents start at 6, 12 and 21, chunk starts at CP 2 or CP 4 (where the
passed state and window must be dropped), and at 13, a token after one."""


def _gated_deltanet_rank(size: int) -> list[dict[str, torch.Tensor]]:
    """A Gated DeltaNet layer's output and input and weight gradients for the packed rows
    and for continuous rows: at CP ``size`` (this rank's tokens; weight gradients summed
    over the ranks) and, on rank 0, one process's on the whole rows."""
    import torch.distributed as dist

    from temper.kernels.ring_attention import load_balanced_indices
    from temper.models.layers.context import ForwardContext
    from temper.models.layers.gated_deltanet import GatedDeltaNet

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    layer = GatedDeltaNet(16, 2, 4, 8, 6, conv_kernel=4, norm_eps=1e-6)
    with torch.no_grad():
        layer.init_weights(0.2, 0.2)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(len(GDN_DOCUMENTS), SEQ_LEN, 16, generator=g)
    grad = torch.randn(len(GDN_DOCUMENTS), SEQ_LEN, 16, generator=g)
    columns = load_balanced_indices(SEQ_LEN, rank, size)
    empty = torch.empty(0)

    def run(inputs: torch.Tensor, out_grad: torch.Tensor, ctx: ForwardContext) -> dict:
        layer.zero_grad(set_to_none=True)
        inputs = inputs.clone().requires_grad_()
        out = layer(inputs, ctx)
        (out * out_grad).sum().backward()
        result = {"out": out.detach(), "x": inputs.grad}
        for name, p in layer.named_parameters():
            result[name] = p.grad.clone()
            if ctx.context_group is not None:
                dist.all_reduce(result[name])
        return result

    results = []
    for docs in (DocumentMask.from_position_ids(_positions(GDN_DOCUMENTS)), None):
        split = ForwardContext(empty, empty, docs=docs, context_group=dist.group.WORLD)
        results.append(run(x[:, columns], grad[:, columns], split))
        if rank == 0:
            results.append(run(x, grad, ForwardContext(empty, empty, docs=docs)))
    return results


@pytest.mark.parametrize("size", [2, 4])
def test_gated_deltanet_matches_one_process(size: int) -> None:
    """Gated DeltaNet at CP ``size`` (the recurrent state and the convolution window passed
    along the chunk order) gives one process's output and input and weight gradients within
    1e-5, on packed rows (``GDN_DOCUMENTS``: chunks start inside documents, 1-2 tokens after
    a document start, so the passed window is partly reset, and at document starts) and on
    continuous rows. Measured: passes; it fails without the state's reset or the window's."""
    ranks = run_on_ranks(_gated_deltanet_rank, size, size)
    for case, name in ((0, "packed"), (1, "continuous")):
        want = ranks[0][2 * case + 1]
        for key, expected in want.items():
            if key in ("out", "x"):
                got = unshard([rank[case if r else 2 * case][key] for r, rank in enumerate(ranks)])
            else:
                got = ranks[0][2 * case][key]
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=f"{name} {key}")


@pytest.mark.parametrize("size", [2, 4])
def test_layout_round_trips(size: int) -> None:
    """21 tokens at CP ``size``: padded to a multiple of 2 x cp with pads at PAD_POSITION and
    label -100, rank r holds chunks r and 2cp-1-r (positions global), the real tokens lead
    each rank's slice (``valid_len``), and ``unshard`` restores the padded rows, for a
    preference batch's two sides alike."""
    s = 21
    ids = torch.arange(1, 2 * s + 1).view(2, s)
    positions = _positions()[:, :s]
    side = {"input_ids": ids, "labels": ids + 100, "position_ids": positions}
    batch = {f"{p}{key}": t for p in ("chosen_", "rejected_") for key, t in side.items()}
    shards = [shard_batch(batch, rank, size) for rank in range(size)]
    padded = 24
    chunk = padded // (2 * size)
    for p in ("chosen_", "rejected_"):
        whole = {key: unshard([shard[p + key] for shard in shards]) for key in side}
        assert torch.equal(whole["input_ids"][:, :s], ids)
        assert torch.equal(whole["input_ids"][:, s:], torch.zeros(2, padded - s, dtype=ids.dtype))
        assert torch.equal(whole["labels"][:, s:], torch.full((2, padded - s), -100))
        assert torch.equal(whole["position_ids"][:, :s], positions)
        assert (whole["position_ids"][:, s:] == PAD_POSITION).all()
        for rank, shard in enumerate(shards):
            mine = torch.cat(
                [
                    ids[:, rank * chunk : (rank + 1) * chunk],
                    torch.nn.functional.pad(ids, (0, padded - s))[
                        :, (2 * size - 1 - rank) * chunk : (2 * size - rank) * chunk
                    ],
                ],
                dim=1,
            )
            assert torch.equal(shard[p + "input_ids"], mine)
            assert torch.equal(shard[p + DOCUMENT_POSITIONS], whole["position_ids"])
            info = shard[p + SEQUENCE_SHARD]
            assert info.seq_len == padded
            assert (shard[p + "input_ids"][:, : info.valid_len] != 0).all()
            assert (shard[p + "input_ids"][:, info.valid_len :] == 0).all()


FAMILIES = ("qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3", "qwen3_5", "qwen3_5_moe", "qwen3_next")
"""GQA with q/k norms; with MoE routing statistics over real tokens; sinks and sliding windows;
MLA; the Gated DeltaNet hybrids, dense and MoE (their state and convolution window passed
between the ranks). Llama 3 runs through the trainer below; DeepSeek sparse attention (V3.2,
GLM-5) and DeepSeek V4 are tested in test_dsa_context_parallel.py; MTP in test_mtp.py."""


@pytest.mark.slow
def test_families_at_cp2_give_one_process_logits_loss_and_gradients() -> None:
    """Each family's debug model wired for CP 2 on a packed batch of 21 tokens (documents of
    5, 9 and 7, crossing the 6-token chunks; padded to 24): the real tokens' logits, the loss
    (with the MoE load-balancing term) and every parameter's gradient (summed over the ranks,
    as FSDP's reduce-scatter does) equal one process's on the unpadded batch."""
    for family, (got, want) in zip(FAMILIES, run_on_ranks(_family_rank, 2)[0], strict=True):
        assert_same_logits_loss_and_grads(family, got, want)


def _family_rank() -> list[tuple[dict[str, object], dict[str, object]]] | None:
    import torch.distributed as dist

    from temper.parallel.context_parallel import ContextParallel, gather_sequence
    from temper.utils.device import init_runtime

    init_runtime()
    group = dist.group.WORLD
    cp = ContextParallel(group)
    return families_against_one_process(
        cp, FAMILIES, (5, 9, 7), lambda x: gather_sequence(x, group)
    )


CP2 = Layout("cp2", world=2, local_batch=4, parallelism={"cp": 2})


@pytest.mark.slow
def test_llama3_trains_at_cp2_like_one_process(tmp_path: Path) -> None:
    """llama3_debug through the trainer at CP 2 (its 2 ranks also FSDP's shard group) on
    packed rows of 62 tokens (``data.isolate_documents``: positions restart at each document;
    the first rows' later documents start at tokens 4, 13, 18, 21, 25, 29 and 40, across the
    chunks; padded to 64 for 2 x 2 chunks of 16), without and with selective activation
    checkpointing (which recomputes inside ring attention's forward): every step's loss and
    gradient norm within 1e-5 of one process accumulating the same global batch (measured:
    at most 2.3e-6). At 30 tokens the fifth step's gradient norm, where the loss jumps, came
    out 1.0e-5 apart: the ring's fp32 sums differ from SDPA's by rounding, and this run
    amplifies it."""
    runs = {}
    for layout, mode in ((SINGLE, "none"), (CP2, "none"), (CP2, "selective")):
        config = parity_config(llama3_debug, tmp_path / mode, layout)
        config.training.seq_len = 62
        config.data.isolate_documents = True
        config.activation_checkpoint.mode = mode
        runs[layout.name, mode] = train_layout(config, layout)
    for mode in ("none", "selective"):
        assert len(runs["cp2", mode].rows) == STEPS
        assert_same_metrics(runs["cp2", mode].rows, runs["single", "none"].rows)


@pytest.mark.slow
def test_qwen3_moe_trains_at_cp2_ep2_like_one_process(tmp_path: Path) -> None:
    """qwen3_moe_debug at CP 2 x EP 2 (the 2 ranks are the CP group, the FSDP group and the
    expert group) on packed 30-token rows: the same losses and gradient norms as one process
    (measured: at most 7.5e-7). Both CP ranks read the same rows, so each global micro-batch
    is the reference's (the load-balancing loss, taken over all ranks' tokens, is
    comparable). On 62-token rows the fifth step's gradient norm came out 2.8e-5 apart (SP 2
    x EP 2 on the same rows: 6.0e-6; both within 2.4e-6 before it): routing amplifies the
    rounding by which the ring's fp32 sums differ from SDPA's."""
    cp2_ep2 = Layout("cp2_ep2", world=2, local_batch=4, parallelism={"cp": 2, "ep": 2})
    runs = {}
    for layout in (SINGLE, cp2_ep2):
        config = parity_config(qwen3_moe_debug, tmp_path, layout)
        config.training.seq_len = 30
        config.data.isolate_documents = True
        runs[layout.name] = train_layout(config, layout)
    assert_same_metrics(runs["cp2_ep2"].rows, runs["single"].rows)


@pytest.mark.slow
def test_qwen3_5_trains_at_cp2_with_checkpointing_like_one_process(tmp_path: Path) -> None:
    """qwen3_5_debug (3 Gated DeltaNet layers, 1 attention) through the trainer at CP 2 with
    full activation checkpointing, whose recomputation reruns the state passing between the
    ranks inside the backward, on packed 62-token rows: every step's loss and gradient norm
    within 1e-5 of one process (measured: 1.2e-7; without checkpointing and with selective,
    the same)."""
    runs = {}
    for layout, mode in ((SINGLE, "none"), (CP2, "full")):
        config = parity_config(qwen3_5_debug, tmp_path / mode, layout)
        config.training.seq_len = 62
        config.data.isolate_documents = True
        config.activation_checkpoint.mode = mode
        runs[layout.name] = train_layout(config, layout)
    assert len(runs["cp2"].rows) == STEPS
    assert_same_metrics(runs["cp2"].rows, runs["single"].rows)


@pytest.mark.slow
def test_dpo_at_cp2_trains_like_one_process(tmp_path: Path) -> None:
    """DPO (sigmoid) at CP 2 on 63-token pairs (each side padded to 64 and sharded): the
    sides' sequence sums meet over the CP group as over SP's, so 2 steps' losses, gradient
    norms and reward margins equal one process's (measured: 1.4e-6 relative; simpo checked
    by hand the same way, 3.5e-7)."""
    from test_rollout_layouts import _dpo_config, _train_rows

    single = run_on_ranks(_train_rows, 1, [_dpo_config(tmp_path / "single", 1, "sigmoid")])[0]
    config = _dpo_config(tmp_path / "cp", 1, "sigmoid")
    config.parallelism.cp = 2
    cp = run_on_ranks(_train_rows, 2, [config])[0]
    assert all(row["grad_norm"] > 0 for row in single)
    assert_same_metrics(cp, single)
    for row, ref in zip(cp, single, strict=True):
        assert row["reward_margin"] == pytest.approx(ref["reward_margin"], rel=1e-5, abs=1e-5)


def _with(recipe: Callable[[], Config], **fields: object) -> Config:
    config = recipe()
    config.parallelism.cp = 2
    for path, value in fields.items():
        section, name = path.split("__")
        setattr(getattr(config, section), name, value)
    return config


@pytest.mark.parametrize(
    ("config", "world", "message"),
    [
        (
            _with(llama3_debug, optimizer__name="muon", optimizer__muon_qk_clip=100.0),
            2,
            "parallelism.cp = 2 with optimizer.muon_qk_clip",
        ),
    ],
    ids=["muon_qk_clip"],
)
def test_paths_not_built_are_refused_naming_parallelism_cp(
    config: Config, world: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        config.validate(world_size=world)
    config.parallelism.cp = 1
    config.validate(world_size=world)  # the same run without CP is valid
