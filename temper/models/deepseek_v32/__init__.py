"""DeepSeek V3.2 family (`deepseek_v32`): DeepSeek V3 with DeepSeek Sparse Attention."""

from temper.models.deepseek_v32.args import FLAVORS, DeepseekV32Args
from temper.models.deepseek_v32.hf import ADAPTER
from temper.models.deepseek_v32.model import DeepseekV32Transformer
from temper.models.registry import ModelSpec, register_model

register_model(
    ModelSpec(
        "deepseek_v32",
        FLAVORS,
        DeepseekV32Transformer,
        hf_adapter=ADAPTER,
    )
)

__all__ = ["FLAVORS", "DeepseekV32Args", "DeepseekV32Transformer"]
