"""Context parallelism: the load-balanced layout and ring attention (gloo ranks, CPU, fp32).

Ring attention at CP 2 and CP 4 gives one process's attention (``attention(..., "sdpa")`` on
the whole sequence) and its q, k, v and sink gradients within 1e-5, on packed rows whose
documents cross the chunk boundaries and end in padding, with GQA, sinks, a sliding window
and MLA's head sizes (v narrower than q/k, its own scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from harness import run_on_ranks

from temper.data.batch import DOCUMENT_POSITIONS, SEQUENCE_SHARD
from temper.kernels.attention import DocumentMask, attention
from temper.parallel.context_parallel import shard_batch, unshard
from temper.parallel.ulysses import PAD_POSITION

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


CP2_CASES = (
    Case("gqa_documents"),
    Case("causal_rows", packed=False),
    Case("sinks_window", window=5, sinks=True),
    Case("mla", kv_heads=4, head_dim=12, v_dim=6, scale=0.3),
)
CP4_CASES = (Case("all", window=4, sinks=True, v_dim=6),)


def _positions() -> torch.Tensor:
    rows = []
    for lengths in DOCUMENTS:
        row = torch.cat([torch.arange(n) for n in lengths])
        rows.append(torch.cat([row, torch.full((SEQ_LEN - len(row),), PAD_POSITION)]))
    return torch.stack(rows)


def _inputs(case: Case) -> dict[str, torch.Tensor]:
    """The whole sequences' q, k, v, sinks and output gradient, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    b = len(DOCUMENTS)

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
    return DocumentMask.from_position_ids(_positions()) if case.packed else None


def _ring_rank(cases: tuple[Case, ...], query_tile: int) -> list[dict[str, torch.Tensor]]:
    """Each case's local output and gradients on this rank."""
    import torch.distributed as dist

    from temper.kernels.ring_attention import load_balanced_indices, ring_attention
    from temper.parallel.context_parallel import gather_sequence

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    columns = load_balanced_indices(SEQ_LEN, rank, size)
    results = []
    for case in cases:
        inputs = _inputs(case)
        q, k, v = (inputs[n][:, columns].requires_grad_() for n in ("q", "k", "v"))
        sinks = inputs["sinks"].requires_grad_() if case.sinks else None
        group = dist.group.WORLD
        out = ring_attention(
            q,
            k,
            v,
            _docs(case),
            group,
            scale=case.scale,
            window=case.window,
            sinks=sinks,
            query_tile=query_tile,
        )
        (out * inputs["grad"][:, columns]).sum().backward()
        result = {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
        if sinks is not None:
            result["sinks"] = sinks.grad
        result["gathered"] = gather_sequence(out.detach(), group)
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


@pytest.mark.parametrize(
    ("size", "cases", "query_tile"), [(2, CP2_CASES, 5), (4, CP4_CASES, 1024)], ids=["cp2", "cp4"]
)
def test_ring_attention_matches_one_process(
    size: int, cases: tuple[Case, ...], query_tile: int
) -> None:
    """Outputs and gradients of every case, each rank's tokens put back in global order; at
    CP 2 the 12 local queries go in tiles of 5 (5, 5, 2), at CP 4 in one."""
    ranks = run_on_ranks(_ring_rank, size, cases, query_tile)
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
