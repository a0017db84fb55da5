"""Rollout engines: what samples an RL objective's completions (``base.RolloutEngine``):
``native`` (the training model itself) and ``vllm`` (a vLLM server)."""

from temper.generation.engines.base import RolloutEngine, SamplingParams
from temper.generation.engines.native import NativeEngine

__all__ = ["NativeEngine", "RolloutEngine", "SamplingParams"]
