"""Native model families; importing this package registers the built-in ones."""

# First: a repository id in model.hf_path becomes its folder before any rule reads it.
import temper.models.hub  # noqa: F401
from temper.models import deepseek_v3 as deepseek_v3
from temper.models import deepseek_v4 as deepseek_v4
from temper.models import deepseek_v32 as deepseek_v32
from temper.models import glm_moe_dsa as glm_moe_dsa
from temper.models import gpt_oss as gpt_oss
from temper.models import llama3 as llama3
from temper.models import qwen3 as qwen3
from temper.models import qwen3_5 as qwen3_5
from temper.models import qwen3_5_moe as qwen3_5_moe
from temper.models import qwen3_5_vl as qwen3_5_vl
from temper.models import qwen3_moe as qwen3_moe
from temper.models import qwen3_next as qwen3_next
from temper.models.hf import (
    HFAdapter,
    KeyRule,
    build_hf_model,
    load_hf,
    load_hf_weights,
    materialize,
    save_hf,
)
from temper.models.registry import (
    ModelSpec,
    build_model,
    get_model_spec,
    model_names,
    register_model,
)

__all__ = [
    "HFAdapter",
    "build_hf_model",
    "materialize",
    "KeyRule",
    "load_hf",
    "load_hf_weights",
    "save_hf",
    "ModelSpec",
    "build_model",
    "get_model_spec",
    "model_names",
    "register_model",
]
