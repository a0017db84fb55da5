"""DeepSeek V4 family (`deepseek_v4`): compressed sparse and heavily compressed attention,
manifold-constrained hyper-connections, hash-routed and top-k experts."""

from temper.models.deepseek_v4.args import FLAVORS, DeepseekV4Args, check_v4_layout
from temper.models.deepseek_v4.hf import ADAPTER
from temper.models.deepseek_v4.model import DeepseekV4Transformer
from temper.models.registry import ModelSpec, register_model

register_model(
    ModelSpec(
        "deepseek_v4",
        FLAVORS,
        DeepseekV4Transformer,
        hf_adapter=ADAPTER,
        check_layout=check_v4_layout,
    )
)

__all__ = ["FLAVORS", "DeepseekV4Args", "DeepseekV4Transformer"]
