"""The plan of a run at a target world size: every config error the run would hit, each
rank's memory (state, activations, gathered weights, the step's peak) and the bytes each
rank moves per optimizer step, from the real layout and a shape-only forward."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from temper.config import Config, ConfigError, registered_rules
from temper.data.loader import check_data
from temper.engine.engine import build_run_model, load_run_tokenizer
from temper.models.layers.mlp import keep_products
from temper.models.layers.moe import moe_layers
from temper.objectives import CausalLM
from temper.parallel.dims import ParallelDims
from temper.parallel.parallelize import parallelize_decoder
from temper.plan.activations import Activations, measure_activations, planned_kernels
from temper.plan.layout import (
    StateBytes,
    Unit,
    describe_params,
    fsdp_units,
    rank_coordinates,
    state_bytes,
)
from temper.utils.compat import init_fake_process_group
from temper.utils.device import resolve_dtype

EP_IMBALANCE = 1.4
"""The busiest expert-parallel rank receives this many times its even share of routed rows
(``--ep_imbalance``). Measured: the third step of the debug MoE recipes on 2 ranks from a
random init (``python -m bench.plan_memory``, docs/observability.md)."""


@dataclass(frozen=True)
class RankMemory:
    """One rank's bytes at the peak of a training step."""

    state: StateBytes
    activations: int
    """Held at the start of backward: the micro-batch's saved activations (checkpointing
    applied) with one block's recomputation under full or selective."""
    gathered: int
    """Weights in compute dtype beside the masters: FSDP's unsharded weights and gradients in
    flight (all-gathers, prefetch, reduce-scatter inputs, units kept gathered between forward
    and backward); unsharded in bf16, autocast's copies."""
    peak: int
    """The largest of the end of forward's (state, gathered, what the blocks hold and the
    loss's own peak), the backward peak (state, activations, gathered, gradients so far) and
    the optimizer step's (state, gradients, its temporaries)."""


@dataclass
class Communication:
    """Bytes one rank receives per optimizer step, by collective."""

    all_gather: float = 0.0
    reduce_scatter: float = 0.0
    all_reduce: float = 0.0
    all_to_all_ep: float = 0.0
    all_to_all_sp: float = 0.0
    ring_cp: float = 0.0


@dataclass
class Plan:
    config: Config
    world_size: int
    device: str
    errors: list[str] = field(default_factory=list)
    dims: ParallelDims | None = None
    ranks: list[RankMemory] = field(default_factory=list)
    communication: Communication | None = None
    activations: Activations | None = None
    tokens: tuple[int, int] = (0, 0)
    """(rows, tokens per row) of one rank's micro-batch."""
    grad_accum: int = 1
    compute_dtype: torch.dtype = torch.float32
    ep_imbalance: float = EP_IMBALANCE
    """Under EP every rank is planned as the busiest (any may be): it receives this many
    times its even share of routed rows."""
    flops_per_token: float = 0.0
    """Training FLOPs per token at the run's ``seq_len``: the model's own count, the one MFU
    divides by (for sparse attention, the keys each query attends to and the indexer's
    scores, not dense attention)."""


def plan_run(
    config: Config, world_size: int, device: str = "cuda", ep_imbalance: float = EP_IMBALANCE
) -> Plan:
    """Check ``config`` for ``world_size`` ranks on ``device`` (cuda or cpu) and, when it
    passes, lay it out and estimate each rank's memory and communication; under expert
    parallelism for a rank receiving ``ep_imbalance`` times its even share of routed rows.
    Runs in one process (a fake process group stands in for the others); needs no
    accelerator."""
    if ep_imbalance < 1:
        raise ValueError(f"ep_imbalance {ep_imbalance} must be >= 1 (1: even routing)")
    plan = Plan(config, world_size, device, ep_imbalance=ep_imbalance)
    plan.errors = config_errors(config, world_size)
    if plan.errors:
        return plan
    dims = plan.dims = ParallelDims.from_config(config.parallelism, world_size)
    dtype = plan.compute_dtype = resolve_dtype(config.training.dtype, torch.device(device))
    tokenizer = load_run_tokenizer(config)
    model = build_run_model(config, tokenizer)
    meshes = None
    if dims.sharded:
        init_fake_process_group(0, world_size)
    try:
        meshes = dims.build_meshes("cpu") if dims.sharded else None
        try:
            parallelize_decoder(model, config, meshes, dtype)
        except (ConfigError, ValueError) as error:
            plan.errors.append(f"parallelism: {error}")
            return plan
        params = describe_params(model, config.optimizer.name)
        units = fsdp_units(model, params) if dims.sharded else []
        coords = rank_coordinates(meshes, world_size)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    plan.grad_accum = dims.grad_accum_steps(config.training)
    seq_len = config.training.seq_len
    # A rank's tokens: SP pads to a multiple of sp, CP to one of 2 x cp (x sp under CP x SP:
    # each CP rank's two chunks cut into sp slices).
    multiple = dims.sp * (1 if dims.cp == 1 else 2 * dims.cp)
    length = -(-seq_len // multiple) * multiple // (dims.cp * dims.sp)
    plan.tokens = (config.training.local_batch_size, length)
    unsharded = build_run_model(config, tokenizer)
    plan.flops_per_token = unsharded.flops_per_token(seq_len)
    if dtype != torch.float32:
        unsharded = unsharded.to(dtype)
    if config.activation_checkpoint.mode == "full":
        keep_products(unsharded.layers)  # as the run's checkpointed blocks do
    imbalance = ep_imbalance if dims.ep > 1 else None
    plan.activations = measure_activations(
        config,
        unsharded,
        CausalLM(kernels=planned_kernels(config.kernels, device)),
        plan.tokens,
        device,
        imbalance,
        dims.sp,
        dims.cp,
    )
    block_grads = _block_param_bytes(unsharded, dims.fsdp)
    shards = list(params.values())
    compute = torch.empty((), dtype=dtype).element_size()
    if dims.sharded:
        gathered = _gathered_bytes(units, compute)
    else:  # autocast's compute-dtype copy of each weight, kept for backward
        gathered = 0 if dtype == torch.float32 else sum(p.numel for p in shards) * compute
    for rank in range(world_size):
        state = state_bytes(shards, coords[rank])
        plan.ranks.append(_peak(config, state, plan.activations, gathered, device, block_grads))
    n_moe = len(moe_layers(unsharded))
    top_k = unsharded.args.top_k if n_moe else 0
    plan.communication = communication(
        config, dims, units, plan, n_moe * top_k * unsharded.args.dim
    )
    return plan


def config_errors(config: Config, world_size: int) -> list[str]:
    """What ``Config.validate`` and each registered rule raise for ``world_size``, the data
    files' first records, and the model and tokenizer build: each message once."""
    errors: list[str] = []

    def attempt(check: object, *args: object) -> None:
        try:
            check(*args)  # type: ignore[operator]
        except (ConfigError, OSError, ValueError) as error:
            message = str(error)
            if message not in errors:
                errors.append(message)

    attempt(config.validate, world_size)
    for rule in registered_rules():
        attempt(rule, config, world_size)
    attempt(lambda: check_data(config, load_run_tokenizer(config), 100))
    attempt(lambda: build_run_model(config, load_run_tokenizer(config)))
    return errors


def _block_param_bytes(model: torch.nn.Module, fsdp: int) -> list[int]:
    """Each block's fp32 gradient bytes on one rank (sharded over ``fsdp``)."""
    return [
        sum(4 * p.numel() for p in block.parameters() if p.requires_grad) // fsdp
        for block in model.layers
    ]


def _peak(
    config: Config,
    state: StateBytes,
    acts: Activations,
    gathered: int,
    device: str,
    block_grads: list[int],
) -> RankMemory:
    mode = config.activation_checkpoint.mode
    held = acts.held(mode)
    # Backward from the last block down: its activations are freed as its gradients land;
    # while it runs, two gradients the size of its largest saved tensor are alive, and what
    # the block's later parts saved is already freed.
    live, grads, backward_peak = held, 0, held
    kept = _kept_per_block(acts, mode)
    for block, freed, grad in zip(
        reversed(acts.blocks), reversed(kept), reversed(block_grads), strict=True
    ):
        grads += grad
        peak = live + grads + 2 * block.largest - block.after_largest
        if mode != "none":  # its recomputation's own peak, beside what the others hold
            again = block.forward_peak - (block.kept if mode == "selective" else 0)
            peak = max(peak, live - acts.recomputed(mode) + grads + again)
        backward_peak = max(backward_peak, peak)
        live -= freed
    # In forward: each block's peak beside what the earlier ones hold; last, the loss's.
    forward_peak, before = 0, acts.leading
    for block, held_after in zip(acts.blocks, kept, strict=True):
        forward_peak = max(forward_peak, before + block.forward_peak)
        before += held_after
    forward_peak = max(forward_peak, before + acts.loss_peak)
    backward = state.params + state.optimizer + gathered + max(backward_peak, forward_peak)
    # The step holds every gradient (the embedding's and head's too); foreach AdamW (CPU)
    # adds a temporary the size of the gradients, fused AdamW (CUDA) none.
    step_temp = state.grads if device == "cpu" else 0
    step = state.params + state.optimizer + state.grads + step_temp
    return RankMemory(state, held, gathered, max(backward, step))


def _kept_per_block(acts: Activations, mode: str) -> list[int]:
    """Bytes each block frees when its backward is done."""
    if mode == "none":
        return [b.saved for b in acts.blocks]
    if mode == "full":
        return [b.input for b in acts.blocks]
    return [b.input + b.kept for b in acts.blocks]


def _gathered_bytes(units: list[Unit], compute: int) -> int:
    """Weights gathered at the worst moment: every unit that stays gathered from its forward
    to its backward, two of the others (one computing, the next prefetched), and the largest
    unit's unsharded gradient (compute dtype, plus the fp32 copy the reduce-scatter takes in
    mixed precision)."""
    sharded = [u for u in units if u.shard_degree > 1]
    if not sharded:
        return 0
    kept = sum(u.gathered_numel() for u in sharded if not u.reshard_after_forward)
    moving = sorted((u.gathered_numel() for u in sharded if u.reshard_after_forward), reverse=True)
    largest = max(u.gathered_numel() for u in sharded)
    grad_copy = 4 if compute != 4 else 0
    return (kept + sum(moving[:2])) * compute + largest * (compute + grad_copy)


def communication(
    config: Config, dims: ParallelDims, units: list[Unit], plan: Plan, routed_width: int
) -> Communication:
    """Bytes one rank receives per optimizer step (ring collectives: an all-gather or
    reduce-scatter over n ranks moves (n - 1) / n of the full tensor, an all-reduce twice
    that; an all-to-all (n - 1) / n of its input). FSDP gathers each unit in forward and,
    if it resharded, again in backward, and reduce-scatters fp32 gradients each micro-batch;
    EP's all-to-alls run twice in forward (dispatch, combine) and twice in backward, again
    in a full checkpoint's recomputation: the busiest rank receives ``ep_imbalance`` times
    its share in the dispatch and its backward, its share in the combine and its backward;
    Ulysses exchanges each token mixer's q, k, v, per-head inputs and output; ring attention
    passes k and v to the next CP rank cp - 1 times in forward (again in a full
    checkpoint's recomputation) and in backward, with their fp32 gradients cp times.
    ``routed_width``: MoE layers x top_k x model width, the elements a token sends."""
    comm = Communication()
    compute = torch.empty((), dtype=plan.compute_dtype).element_size()
    micro = plan.grad_accum
    full_recompute = config.activation_checkpoint.mode == "full"
    for unit in units:
        n, full = unit.shard_degree, unit.gathered_numel()
        if n > 1:
            gathers = 2 if unit.reshard_after_forward else 1
            comm.all_gather += micro * gathers * full * compute * (n - 1) / n
            comm.reduce_scatter += micro * full * 4 * (n - 1) / n
        if unit.replicas > 1:
            shard = full / n
            comm.all_reduce += micro * 2 * shard * 4 * (unit.replicas - 1) / unit.replicas
    rows, length = plan.tokens
    if dims.ep > 1:
        passes = (4 + (2 if full_recompute else 0)) * (1 + plan.ep_imbalance) / 2
        sent = rows * length * routed_width * compute
        comm.all_to_all_ep += micro * passes * sent * (dims.ep - 1) / dims.ep
    if dims.sp > 1 and plan.activations is not None:
        passes = 2 + (1 if full_recompute else 0)
        io = plan.activations.attention_io
        comm.all_to_all_sp += micro * passes * io * (dims.sp - 1) / dims.sp
    if dims.cp > 1 and plan.activations is not None:
        kv = plan.activations.attention_kv
        passes = 2 + (1 if full_recompute else 0)
        comm.ring_cp += micro * kv * ((dims.cp - 1) * passes + dims.cp * 4 / compute)
    return comm
