"""DeepSeek V3 family (also Moonlight and other `deepseek_v3` checkpoints)."""

from temper.models.deepseek_v3.args import FLAVORS, DeepseekV3Args
from temper.models.deepseek_v3.hf import ADAPTER
from temper.models.deepseek_v3.model import DeepseekV3Transformer
from temper.models.registry import ModelSpec, register_model

register_model(ModelSpec("deepseek_v3", FLAVORS, DeepseekV3Transformer, hf_adapter=ADAPTER))

__all__ = ["FLAVORS", "DeepseekV3Args", "DeepseekV3Transformer"]
