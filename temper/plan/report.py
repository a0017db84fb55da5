"""The plan as text: the layout, each group of ranks that hold the same bytes, the step's
communication, and the config errors the run would hit."""

from __future__ import annotations

from itertools import groupby

from temper.plan.planner import Plan, RankMemory

GIB = 2**30


def format_plan(plan: Plan) -> str:
    config = plan.config
    name = config.model.hf_path or f"{config.model.name}/{config.model.flavor}"
    lines = [f"temper plan: {name}, world {plan.world_size} on {plan.device}"]
    if plan.errors:
        lines.append(f"config errors the run would hit ({len(plan.errors)}):")
        lines += [f"  - {error}" for error in plan.errors]
        return "\n".join(lines)
    dims, (rows, length) = plan.dims, plan.tokens
    assert dims is not None and plan.communication is not None
    dtype = str(plan.compute_dtype).removeprefix("torch.")
    lines.append(
        f"layout: dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard} x cp {dims.cp} x "
        f"sp {dims.sp}, "
        f"ep {dims.ep} (efsdp {dims.efsdp}); {dtype} compute, fp32 masters, "
        f"{config.optimizer.name}, activation checkpoint {config.activation_checkpoint.mode}"
    )
    if dims.ep > 1:
        lines.append(
            f"expert parallelism: each rank planned as the busiest, receiving "
            f"{plan.ep_imbalance:g}x its even share of routed rows (--ep_imbalance)"
        )
    lines.append(
        f"micro-batch per rank: {rows} x {length} tokens, {plan.grad_accum} per step "
        "(grad accumulation)"
    )
    lines.append(
        f"training FLOPs per token at {config.training.seq_len} tokens: "
        f"{plan.flops_per_token:.3e} (the count MFU uses)"
    )
    lines.append("")
    lines.append("| ranks | params | grads | optimizer | activations | gathered | peak (GiB) |")
    lines.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    ranks = list(enumerate(plan.ranks))
    for row, group in groupby(ranks, key=lambda item: _cells(item[1])):
        members = [rank for rank, _ in group]
        span = str(members[0]) if len(members) == 1 else f"{members[0]}-{members[-1]}"
        lines.append(f"| {span} | " + " | ".join(row) + " |")
    comm = plan.communication
    lines.append("")
    lines.append(
        "communication per step per rank (GiB received): "
        f"all-gather {comm.all_gather / GIB:.2f}, reduce-scatter {comm.reduce_scatter / GIB:.2f}"
        f", all-reduce {comm.all_reduce / GIB:.2f}, all-to-all EP {comm.all_to_all_ep / GIB:.2f}"
        f", all-to-all SP {comm.all_to_all_sp / GIB:.2f}, ring CP {comm.ring_cp / GIB:.2f}"
    )
    lines.append(
        "peak: tensors only; the runtime's own memory (CUDA context, NCCL buffers, Python) and "
        "allocator fragmentation come on top"
    )
    lines.append("config errors: none")
    return "\n".join(lines)


def _cells(memory: RankMemory) -> tuple[str, ...]:
    s = memory.state
    values = (s.params, s.grads, s.optimizer, memory.activations, memory.gathered, memory.peak)
    return tuple(f"{v / GIB:.3f}" for v in values)
