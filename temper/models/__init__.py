"""Native model families; importing this package registers the built-in ones."""

from temper.models import llama3 as llama3
from temper.models.registry import (
    ModelSpec,
    build_model,
    get_model_spec,
    model_names,
    register_model,
)

__all__ = ["ModelSpec", "build_model", "get_model_spec", "model_names", "register_model"]
