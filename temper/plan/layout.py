"""A run's real parallel layout for a target world size, built in one process: the model on
meta, parallelized (SP, EP, activation checkpointing, FSDP2) over the meshes of rank 0 of a
fake process group, then each rank's shard sizes read from the parameters' placements."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from temper.optim.optimizer import muon_parameters
from temper.parallel.dims import Meshes
from temper.utils.compat import fsdp_reshard_states, sharded_dim


@dataclass(frozen=True)
class ParamShard:
    """One parameter as the layout holds it."""

    shape: tuple[int, ...]
    element_size: int
    trainable: bool
    mesh_dims: tuple[tuple[str, int], ...]
    """(mesh dim name, size) per placement; empty when not distributed."""
    shard_dims: tuple[int | None, ...]
    """The tensor dim each placement shards, None where it replicates."""
    muon: bool
    """Stepped by Muon (one state) rather than AdamW (two)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_numel(self, coords: dict[str, int]) -> int:
        """Elements on the rank at mesh coordinates ``coords``: each sharded dim split in
        ``torch.chunk``'s pieces (the last ranks hold less, or nothing, when uneven)."""
        shape = list(self.shape)
        for (name, size), dim in zip(self.mesh_dims, self.shard_dims, strict=True):
            if dim is None:
                continue
            chunk = -(-shape[dim] // size)
            start = coords[name] * chunk
            shape[dim] = max(0, min(shape[dim], start + chunk) - start)
        return math.prod(shape)

    def gathered_numel(self) -> int:
        """Elements after FSDP's all-gather: the whole tensor less its expert-parallel split."""
        ep = math.prod(size for name, size in self.mesh_dims if name == "ep")
        return self.numel // ep


@dataclass(frozen=True)
class Unit:
    """An FSDP unit: the parameters one all-gather brings and one reduce-scatter returns."""

    name: str
    params: tuple[ParamShard, ...]
    reshard_after_forward: bool
    shard_degree: int
    """Ranks its parameters are sharded over (fsdp, or efsdp for experts)."""
    replicas: int
    """Replica groups its gradients are all-reduced over (dp_replicate, or edp)."""

    def gathered_numel(self) -> int:
        return sum(p.gathered_numel() for p in self.params)


def describe_params(model: nn.Module, optimizer: str) -> dict[int, ParamShard]:
    """``id(parameter) -> ParamShard`` for every parameter of a parallelized meta model."""
    muon = {id(p) for p in muon_parameters(model)} if optimizer == "muon" else set()
    out = {}
    for p in model.parameters():
        mesh_dims: tuple[tuple[str, int], ...] = ()
        shard_dims: tuple[int | None, ...] = ()
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
            mesh_dims = tuple(zip(names, mesh.shape, strict=True))
            shard_dims = tuple(sharded_dim(q) for q in p.placements)
        out[id(p)] = ParamShard(
            tuple(p.shape), p.element_size(), p.requires_grad, mesh_dims, shard_dims, id(p) in muon
        )
    return out


def fsdp_units(model: nn.Module, params: dict[int, ParamShard]) -> list[Unit]:
    """Each FSDP unit with the parameters it manages itself (not those of a unit inside it),
    in forward order."""
    owner: dict[int, str] = {}
    modules = {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    for name, module in modules.items():  # pre-order: an inner unit overwrites its parent
        for p in module.parameters():
            owner[id(p)] = name
    units = []
    for name, module in modules.items():
        mine = tuple(params[id(p)] for p in module.parameters() if owner[id(p)] == name)
        if not mine:
            continue
        dims = dict(mine[0].mesh_dims)
        shard = math.prod(s for n, s in dims.items() if n not in ("ep", "dp_replicate", "edp"))
        replicas = dims.get("dp_replicate", dims.get("edp", 1))
        reshard = _reshards(module)
        units.append(Unit(name or "<root>", mine, reshard, shard, replicas))
    return units


def _reshards(module: FSDPModule) -> bool:
    """Whether the unit frees its gathered weights after forward (gathers again in backward)."""
    return any(state is not None for state in fsdp_reshard_states(module))


def rank_coordinates(meshes: Meshes | None, world_size: int) -> list[dict[str, int]]:
    """Each rank's coordinate along every named mesh dim."""
    coords: list[dict[str, int]] = [{} for _ in range(world_size)]
    if meshes is None:
        return coords
    for mesh in (meshes.hsdp, meshes.world, meshes.expert):
        if mesh is None:
            continue
        names = mesh.mesh_dim_names or ()
        for index in torch.cartesian_prod(*[torch.arange(s) for s in mesh.shape]).reshape(
            -1, mesh.ndim
        ):
            rank = int(mesh.mesh[tuple(index.tolist())])
            coords[rank].update(zip(names, index.tolist(), strict=True))
    return coords


@dataclass(frozen=True)
class StateBytes:
    """A rank's training state: fp32 master weights, their gradients and optimizer state."""

    params: int
    grads: int
    optimizer: int


def state_bytes(params: list[ParamShard], coords: dict[str, int]) -> StateBytes:
    """AdamW keeps two states per trainable element in the parameter's dtype, Muon one."""
    total = grads = optimizer = 0
    for p in params:
        n = p.local_numel(coords) * p.element_size
        total += n
        if p.trainable:
            grads += n
            optimizer += n if p.muon else 2 * n
    return StateBytes(total, grads, optimizer)
