"""gpt-oss family (gpt-oss-20b, gpt-oss-120b)."""

from temper.models.gpt_oss.args import FLAVORS, GptOssArgs
from temper.models.gpt_oss.hf import ADAPTER
from temper.models.gpt_oss.model import GptOssTransformer
from temper.models.registry import ModelSpec, register_model

register_model(ModelSpec("gpt_oss", FLAVORS, GptOssTransformer, hf_adapter=ADAPTER))

__all__ = ["FLAVORS", "GptOssArgs", "GptOssTransformer"]
