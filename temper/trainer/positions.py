"""Whether ``training.seq_len`` fits the positions the model was built for, checked in the
pre-flight, where the model's arguments are first read."""

from __future__ import annotations

from temper.config import Config, ConfigError
from temper.models.fit import model_args


def check_positions(config: Config) -> None:
    """Refuse a ``training.seq_len`` above the model's ``max_seq_len`` (an HF folder's
    ``max_position_embeddings``): RoPE never saw those positions, and an over-long row costs
    memory the model cannot use well. A model with a RoPE scaling (llama3, yarn) is the
    explicit choice to go further, so it is allowed."""
    _, args, source = model_args(config)
    seq_len, limit = config.training.seq_len, args.max_seq_len
    if seq_len <= limit or args.rope_scaling is not None:
        return
    where = (
        f"max_position_embeddings of {source}/config.json"
        if config.model.hf_path is not None
        else f"max_seq_len of {source}"
    )
    raise ConfigError(
        f"training.seq_len ({seq_len}) is above the model's {limit} positions ({where}): lower "
        "--training.seq_len, or train a model with a RoPE scaling (rope_scaling, e.g. yarn, in "
        "an HF folder's config.json), which allows longer sequences"
    )
