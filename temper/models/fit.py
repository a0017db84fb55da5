"""Whether a parallel layout fits a model's sizes: experts over EP ranks, heads over SP
ranks. A family whose layers split differently states its own rule in its ModelSpec."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from temper.config import Config, ConfigError, Parallelism, register_rule
from temper.models.layers.args import DecoderArgs, MoEArgs

if TYPE_CHECKING:
    from temper.models.registry import ModelSpec


def check_heads(n_heads: int, n_kv_heads: int, sp: int) -> None:
    """Heads must split evenly over SP ranks; KV heads fewer than SP are replicated, so SP must
    then be a multiple of them (each rank gets one copy of one KV head)."""
    if n_heads % sp:
        raise ConfigError(
            f"parallelism.sp ({sp}) must divide the model's attention heads ({n_heads}): "
            "Ulysses gives each SP rank the same number of heads"
        )
    if n_kv_heads % sp and sp % n_kv_heads:
        raise ConfigError(
            f"parallelism.sp ({sp}) and the model's KV heads ({n_kv_heads}) must divide one "
            "another: KV heads are split over SP ranks, or replicated when fewer than SP"
        )


def check_linear_attention_heads(n_k_heads: int, n_v_heads: int, sp: int) -> None:
    """Each SP rank runs whole Gated DeltaNet heads: a slice of the key heads and the value
    heads they serve, so SP must divide both counts (no replication: a key head's state is
    per value head)."""
    if n_k_heads % sp or n_v_heads % sp:
        raise ConfigError(
            f"parallelism.sp ({sp}) must divide the model's Gated DeltaNet key heads "
            f"({n_k_heads}) and value heads ({n_v_heads}): Ulysses gives each SP rank whole "
            "heads for the convolution and the recurrence"
        )


def check_decoder_layout(args: DecoderArgs, parallelism: Parallelism) -> None:
    """The rule of the decoders built on ``models/layers``: routed experts (``MoEArgs``'
    ``n_experts``; none for a dense model) split evenly over ``ep``; attention heads over
    ``sp``."""
    ep, sp = parallelism.ep, parallelism.sp
    n_experts = args.n_experts if isinstance(args, MoEArgs) else 0
    if ep > 1 and not n_experts:
        raise ConfigError(f"parallelism.ep = {ep} needs a mixture-of-experts model; it has none")
    if ep > 1 and n_experts % ep:
        raise ConfigError(f"parallelism.ep ({ep}) must divide the number of experts ({n_experts})")
    if sp > 1:
        # MLA (DeepSeek V3) has no grouped keys and values: its n_kv_heads is n_heads.
        check_heads(args.n_heads, args.n_kv_heads, sp)


def check_hybrid_layout(args: Any, parallelism: Parallelism) -> None:
    """Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next): the decoder rule, and whole linear-
    attention key and value heads on each SP rank (CP splits no heads: the recurrent state
    passes from rank to rank)."""
    check_decoder_layout(args, parallelism)
    if parallelism.sp > 1:
        check_linear_attention_heads(args.linear_n_k_heads, args.linear_n_v_heads, parallelism.sp)


@register_rule
def check_model(config: Config, world_size: int) -> None:
    """``model.*`` names a registered family and flavor (or a readable HF folder), and the
    parallel layout fits its sizes."""
    spec, args, source = model_args(config)
    if config.training.seq_len < config.parallelism.sp:
        raise ConfigError(
            f"training.seq_len ({config.training.seq_len}) must be at least parallelism.sp "
            f"({config.parallelism.sp}): every SP rank holds a slice of each sequence"
        )
    try:
        spec.check_layout(args, config.parallelism)
    except ConfigError as error:
        raise ConfigError(f"{error} ({source})") from None


def model_args(config: Config) -> tuple[ModelSpec, Any, str]:
    """The family, the args and a name for them (the HF folder or family/flavor) that
    ``model.*`` selects; ConfigError naming the field otherwise."""
    from temper.models.hf import read_hf_args
    from temper.models.registry import get_model_spec, model_names, replace_args

    model = config.model
    if model.hf_path is not None:
        try:
            spec, args = read_hf_args(model.hf_path)
        except (OSError, ValueError) as err:
            raise ConfigError(f"model.hf_path: {err}") from err
        source = model.hf_path
    else:
        if model.name not in model_names():
            raise ConfigError(
                f"model.name {model.name!r} is not a registered model; choose one of "
                f"{', '.join(model_names())}"
            )
        flavors = get_model_spec(model.name).flavors
        if model.flavor not in flavors:
            raise ConfigError(
                f"model.flavor {model.flavor!r} is not a flavor of {model.name}; choose one of "
                f"{', '.join(flavors)}"
            )
        spec, args = get_model_spec(model.name), flavors[model.flavor]
        source = f"{model.name}/{model.flavor}"
    try:
        args = replace_args(spec.name, args, model.arg_overrides())
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from err
    return spec, args, source
