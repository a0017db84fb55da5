"""Optimizers and learning-rate schedules."""

from temper.optim.low_bit import state_bytes
from temper.optim.lr_schedule import build_lr_scheduler, lr_factor
from temper.optim.muon import Muon
from temper.optim.offload import OptimizerOffload, OptimizerOffloadedError
from temper.optim.optimizer import build_optimizer

__all__ = [
    "Muon",
    "OptimizerOffload",
    "OptimizerOffloadedError",
    "build_lr_scheduler",
    "build_optimizer",
    "lr_factor",
    "state_bytes",
]
