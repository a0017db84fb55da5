"""Parallel degrees from `--parallelism.*`, checked against the world, and the meshes they name.

Ranks are laid out row-major over ``(dp_replicate, dp_shard, cp, sp)``: the ranks of one
SP group are neighbours, then the CP ranks holding the other parts of the same sequences,
then the shards of one replica, then the replicas. Every mesh
below is a view of that one layout, so a rank's coordinates agree across meshes.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from temper.config import Config, ConfigError, Parallelism, Training, register_rule
from temper.utils.compat import flatten_mesh


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees whose product is the world size (``dp_shard`` is never -1 here), and
    this process's rank in that world."""

    dp_replicate: int
    dp_shard: int
    cp: int
    sp: int
    ep: int
    world_size: int
    rank: int = 0

    @classmethod
    def from_config(cls, parallelism: Parallelism, world_size: int, rank: int = 0) -> ParallelDims:
        """Resolve ``dp_shard = -1`` to the rest of the world and check every rule.

        Runs before any model or process group exists; errors name fields and numbers.
        """
        p = parallelism
        for name in ("dp_replicate", "cp", "sp", "ep"):
            if getattr(p, name) < 1:
                raise ConfigError(f"parallelism.{name} must be >= 1, got {getattr(p, name)}")
        if p.dp_shard == 0 or p.dp_shard < -1:
            raise ConfigError(f"parallelism.dp_shard must be -1 or >= 1, got {p.dp_shard}")
        if world_size < 1:
            raise ConfigError(f"world size must be >= 1, got {world_size}")
        if world_size % (p.dp_replicate * p.cp * p.sp):
            raise ConfigError(
                f"world size {world_size} is not divisible by parallelism.dp_replicate x "
                f"parallelism.cp x parallelism.sp ({p.dp_replicate} x {p.cp} x {p.sp})"
            )
        rest = world_size // (p.dp_replicate * p.cp * p.sp)
        dp_shard = rest if p.dp_shard == -1 else p.dp_shard
        if p.dp_replicate * dp_shard * p.cp * p.sp != world_size:
            raise ConfigError(
                f"parallelism.dp_replicate x dp_shard x cp x sp = {p.dp_replicate} x "
                f"{dp_shard} x {p.cp} x {p.sp} does not equal the world size {world_size}"
            )
        fsdp = dp_shard * p.cp * p.sp
        if fsdp % p.ep:
            raise ConfigError(
                f"parallelism.ep ({p.ep}) must divide parallelism.dp_shard x cp x sp "
                f"({dp_shard} x {p.cp} x {p.sp} = {fsdp}): experts are split within one "
                "FSDP group"
            )
        return cls(p.dp_replicate, dp_shard, p.cp, p.sp, p.ep, world_size, rank)

    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """Ranks one parameter is sharded over: CP and SP ranks hold different tokens, so they
        shard (and sum gradients) like data-parallel ranks."""
        return self.dp_shard * self.cp * self.sp

    @property
    def efsdp(self) -> int:
        """Ranks one expert's weights are sharded over, inside the FSDP group."""
        return self.fsdp // self.ep

    @property
    def sharded(self) -> bool:
        """Whether parameters are sharded: FSDP2 applies to every world larger than one."""
        return self.world_size > 1

    def grad_accum_steps(self, training: Training) -> int:
        """Micro-batches per optimizer step: ``global_batch_size / (local x dp)``."""
        if training.global_batch_size == -1:
            return 1
        return training.global_batch_size // (training.local_batch_size * self.dp)

    @property
    def dp_rank(self) -> int:
        """This process's data shard (``data_rank`` of ``rank``)."""
        return self.data_rank(self.rank)

    def data_rank(self, rank: int) -> int:
        """This rank's index among the `dp` data shards; the ranks of one CP x SP group
        share it."""
        return rank // (self.cp * self.sp)

    def build_meshes(self, device_type: str) -> Meshes:
        """The named meshes (collective: every rank calls this in the same order)."""
        world = init_device_mesh(
            device_type,
            (self.dp_replicate, self.dp_shard, self.cp, self.sp),
            mesh_dim_names=("dp_replicate", "dp_shard", "cp", "sp"),
        )
        if self.cp > 1 and self.sp > 1:
            # The ranks sharing the same rows under CP x SP; objectives reduce over them.
            flatten_mesh(world["cp", "sp"], "cp_sp")
        fsdp = init_device_mesh(
            device_type, (self.dp_replicate, self.fsdp), mesh_dim_names=("dp_replicate", "fsdp")
        )
        expert = None
        if self.ep > 1:
            expert = init_device_mesh(
                device_type,
                (self.dp_replicate, self.efsdp, self.ep),
                mesh_dim_names=("edp", "efsdp", "ep"),
            )
            # Expert weights shard over efsdp x ep; with the pair flattened, DTensor reduces
            # a value that is partial over both (init's whole-tensor reads) in one collective.
            flatten_mesh(expert["efsdp", "ep"], "efsdp_ep")
        return Meshes(world=world, hsdp=fsdp, expert=expert)


@dataclass(frozen=True)
class Meshes:
    """Device meshes over one rank layout; see the module docstring."""

    world: DeviceMesh
    """``(dp_replicate, dp_shard, cp, sp)``: data shards are its first two dims, ``world["cp"]``
    the context-parallel group, ``world["sp"]`` the sequence-parallel one; with both,
    ``world["cp_sp"]`` (flattened) holds every rank of the same rows."""
    hsdp: DeviceMesh
    """``(dp_replicate, fsdp)`` with ``fsdp = dp_shard x cp x sp``: HSDP replicates over the
    first dim and shards over the second."""
    expert: DeviceMesh | None
    """``(edp, efsdp, ep)`` for expert weights when ``ep > 1``: ``edp = dp_replicate`` and
    ``efsdp x ep`` is the FSDP group."""

    @property
    def fsdp(self) -> DeviceMesh:
        """The mesh `fully_shard` takes: 2-D (HSDP) with replicas, else the 1-D shard mesh."""
        return self.hsdp if self.hsdp["dp_replicate"].size() > 1 else self.hsdp["fsdp"]


@register_rule
def check_parallelism(config: Config, world_size: int) -> None:
    """The degrees fit the world and the global batch splits over data ranks."""
    dp = ParallelDims.from_config(config.parallelism, world_size).dp
    local, global_ = config.training.local_batch_size, config.training.global_batch_size
    if global_ != -1 and (global_ <= 0 or global_ % (local * dp)):
        raise ConfigError(
            f"training.global_batch_size ({global_}) must be -1 or a positive multiple of "
            f"training.local_batch_size x data-parallel size ({local} x {dp} = {local * dp})"
        )
