"""Lower-precision training and storage, one module per scheme, each on torchao (imported
only when its scheme is asked for): FP8 matmuls (``float8``), fake-quantized fine-tuning and
its export (``qat``), NF4 base weights under LoRA (``nf4``). ``prepare_model`` applies what a
config asks to the meta model, between LoRA and parallelization.
"""

from temper.quantize.float8 import apply_float8, float8_targets
from temper.quantize.nf4 import quantize_lora_base
from temper.quantize.prepare import finish_model, prepare_model
from temper.quantize.qat import (
    load_quantized,
    prepare_qat,
    quantize_for_inference,
    write_quantization,
)

__all__ = [
    "apply_float8",
    "finish_model",
    "float8_targets",
    "load_quantized",
    "prepare_model",
    "prepare_qat",
    "quantize_for_inference",
    "quantize_lora_base",
    "write_quantization",
]
