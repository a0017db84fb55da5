"""Muon on the blocks' weight matrices, AdamW on everything else, in one optimizer.

Muon (Jordan et al. 2024; Moonlight, Liu et al. 2025) keeps a momentum of the gradient and
steps along its orthogonalization: the quintic Newton-Schulz iteration pushes every singular
value of the (Nesterov) momentum toward one, so no direction of a matrix dominates the update.
It is defined for matrices; embeddings, the LM head, norms, biases and routers keep AdamW.

The math is `torch.optim.Muon`'s (momentum as an EMA, ``grad.lerp(buf, momentum)`` for
Nesterov, Newton-Schulz in bfloat16 unless told otherwise, decoupled weight decay with the
unscaled lr; the trainer's ``muon_ns_dtype auto`` picks float32 on a CPU without bfloat16 units),
extended to stacked experts (``[n_experts, out, in]``: each expert's matrix orthogonalized on
its own) and to sharded parameters: a row-sharded (FSDP) matrix is orthogonalized once, by one
rank, from its whole update (`RowShardedMatrices`); a rank holding whole matrices (one process,
or its own experts under expert parallelism) orthogonalizes them where they are.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from temper.config import Config, ConfigError, register_rule
from temper.optim.qk_clip import QKClip, clippable_attention
from temper.optim.sharded_matrices import CommStats, RowShardedMatrices, row_shard_dim

# Keller Jordan's coefficients, the ones torch.optim.Muon uses: the steepest slope at zero
# that still keeps every singular value within about [0.7, 1.2] after five steps.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7

UpdateScale = Literal["match_rms_adamw", "original"]
Distribute = Literal["size", "round_robin"]


def orthogonalize(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The quintic Newton-Schulz approximation of ``U V^T`` for ``update = U S V^T``, per matrix
    of the last two dims (a ``[n, rows, cols]`` stack is n independent matrices), in ``dtype``.

    It iterates on the wide orientation (rows <= cols), so the Gram matrix is the small one,
    after scaling each matrix to unit Frobenius norm (spectral norm <= 1).
    """
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = update.size(-2) > update.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        x = x.div(x.norm().clamp(min=NS_EPS))
        mm = torch.addmm
    else:
        x = x.div(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=NS_EPS))
        mm = torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        poly = mm(gram, gram, gram, beta=b, alpha=c)
        x = mm(x, poly, x, beta=a)
    return x.mT if tall else x


def update_scale(shape: torch.Size, rule: UpdateScale, rms: float) -> float:
    """Multiplier of the lr for one ``[rows, cols]`` matrix.

    ``match_rms_adamw`` (Moonlight): an orthogonal update of a ``rows x cols`` matrix has RMS
    ``1 / sqrt(max(rows, cols))``; scaling by ``rms * sqrt(max)`` gives it AdamW's typical RMS,
    so AdamW's lr and weight decay carry over. ``original`` (Keller Jordan):
    ``sqrt(max(1, rows / cols))``, with an lr tuned for Muon (about 0.02).
    """
    rows, cols = shape[-2], shape[-1]
    if rule == "match_rms_adamw":
        return rms * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


class Muon(torch.optim.Optimizer):
    """Param groups with ``algorithm="muon"`` step with Muon, ``"adamw"`` ones with AdamW.

    One optimizer for both, so the trainer, the LR schedule (each group scales from its own
    lr), DCP checkpoints and optimizer offload see one object. State per parameter is
    ``momentum_buffer`` (Muon) or ``step``, ``exp_avg``, ``exp_avg_sq`` (AdamW's names), each
    sharded like its parameter, so DCP reshards it at another layout.
    """

    def __init__(
        self,
        params: list[dict[str, Any]],
        *,
        lr: float,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_dtype: str = "bfloat16",
        scale_rule: UpdateScale = "match_rms_adamw",
        update_rms: float = 0.2,
        distribute: Distribute = "size",
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        qk_clip: QKClip | None = None,
    ) -> None:
        defaults = dict(
            algorithm="muon",
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_dtype=ns_dtype,
            scale_rule=scale_rule,
            update_rms=update_rms,
            distribute=distribute,
            betas=betas,
            eps=eps,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["algorithm"] not in ("muon", "adamw"):
                raise ValueError(f"param group algorithm must be muon or adamw: {group}")
            if group["algorithm"] == "muon":
                for p in group["params"]:
                    if p.ndim not in (2, 3):
                        raise ValueError(
                            f"Muon steps matrices ([rows, cols]) or stacked experts "
                            f"([n, rows, cols]); got a parameter of shape {tuple(p.shape)}"
                        )
        self.qk_clip = qk_clip
        self._exchanges: dict[tuple[Any, ...], RowShardedMatrices] = {}
        # Bytes this rank sent and received for Muon in the latest step, and what gathering
        # every sharded matrix on every rank would have received.
        self.comm = CommStats()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stats = CommStats()
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                self._adamw(group)
            else:
                self._muon(group, stats)
        self.comm = stats
        if self.qk_clip is not None:
            self.qk_clip.apply()
        return loss

    def set_offloaded(self, offloaded: bool) -> None:
        """`OptimizerOffload`'s notice: QK-clip ignores the forwards of an offloaded spell
        (rollouts), which are no training step's."""
        if self.qk_clip is not None:
            self.qk_clip.pause(offloaded)

    def _muon(self, group: dict[str, Any], stats: CommStats) -> None:
        """Momentum on local shards; orthogonalize whole matrices where they are, row-sharded
        ones at their owner rank; then the update, on local shards again."""
        steps, dtype = group["ns_steps"], getattr(torch, group["ns_dtype"])
        sharded: dict[RowShardedMatrices, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            grad, buf = _local(p.grad), _local(state["momentum_buffer"])
            buf.lerp_(grad, 1 - group["momentum"])
            update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
            shard_dim = row_shard_dim(p)
            if shard_dim is None:
                self._apply(p, orthogonalize(update, steps, dtype), group)
            else:
                sharded.setdefault(self._exchange(p.device_mesh, shard_dim), []).append((p, update))
        for exchange, items in sharded.items():
            results = exchange.orthogonalize(
                [update for _, update in items],
                [p.shape for p, _ in items],
                functools.partial(orthogonalize, steps=steps, dtype=dtype),
                dtype=dtype,
                assign=group["distribute"],
                stats=stats,
            )
            for (p, _), result in zip(items, results, strict=True):
                self._apply(p, result, group)

    def _exchange(self, mesh: DeviceMesh, shard_dim: int) -> RowShardedMatrices:
        """One exchange (and process group) per mesh layout, reused every step."""
        key = (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), shard_dim)
        if key not in self._exchanges:
            self._exchanges[key] = RowShardedMatrices(mesh, shard_dim)
        return self._exchanges[key]

    @staticmethod
    def _apply(p: torch.Tensor, update: torch.Tensor, group: dict[str, Any]) -> None:
        lr = group["lr"]
        scale = update_scale(p.shape, group["scale_rule"], group["update_rms"])
        local = _local(p)
        local.mul_(1 - lr * group["weight_decay"])
        local.add_(update, alpha=-lr * scale)

    def _adamw(self, group: dict[str, Any]) -> None:
        """torch.optim.AdamW's single-tensor update, on local shards."""
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            step = state["step"].item()
            param, grad = _local(p), _local(p.grad)
            exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
            param.mul_(1 - lr * wd)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
            param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@register_rule
def check_optimizer(config: Config, world_size: int) -> None:
    """`Config.validate`'s rules for the ``optimizer.muon_*`` fields (named in the error)."""
    section = config.optimizer
    if section.name != "muon":
        return
    if section.muon_lr is not None and section.muon_lr <= 0:
        raise ConfigError(f"optimizer.muon_lr must be > 0 (or None = lr), got {section.muon_lr}")
    if section.muon_weight_decay is not None and section.muon_weight_decay < 0:
        raise ConfigError(
            f"optimizer.muon_weight_decay must be >= 0 (or None = weight_decay), got "
            f"{section.muon_weight_decay}"
        )
    if not 0.0 <= section.muon_momentum < 1.0:
        raise ConfigError(f"optimizer.muon_momentum must be in [0, 1), got {section.muon_momentum}")
    if not 1 <= section.muon_ns_steps <= 20:
        raise ConfigError(
            f"optimizer.muon_ns_steps must be in [1, 20] (5 is the tuned value), got "
            f"{section.muon_ns_steps}"
        )
    if section.muon_update_rms <= 0:
        raise ConfigError(f"optimizer.muon_update_rms must be > 0, got {section.muon_update_rms}")
    if section.muon_qk_clip < 0:
        raise ConfigError(f"optimizer.muon_qk_clip must be >= 0, got {section.muon_qk_clip}")
    if section.muon_qk_clip > 0:
        if config.parallelism.sp > 1:
            raise ConfigError(
                "optimizer.muon_qk_clip with parallelism.sp > 1: a rank holds a slice of each "
                "sequence's keys, not the whole logits; turn one off"
            )
        if config.compile.enable:
            raise ConfigError(
                "optimizer.muon_qk_clip with compile.enable: the logit statistic is a side "
                "effect a compiled block does not keep; turn one off"
            )
        from temper.models import build_hf_model, build_model

        model = config.model
        # On meta: the architecture's layers, no weights.
        if model.hf_path is not None:
            clippable_attention(build_hf_model(model.hf_path))
        else:
            clippable_attention(build_model(model.name, model.flavor))
