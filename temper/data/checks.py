"""Checks of the data before a run: the config's data rules (``check_data_config``, one of
``Config.validate``'s) and the pre-flight look at every source's first records
(``check_data``)."""

from __future__ import annotations

from temper.config import Config, ConfigError, check_positive, register_rule
from temper.data.formats import FORMATS, build_format, format_spec, is_image_data
from temper.data.sources.base import RecordError
from temper.data.sources.configured import configured_sources, open_split
from temper.data.stream import check_fields
from temper.data.tokenizer import Tokenizer


def check_data(config: Config, tokenizer: Tokenizer, limit: int) -> None:
    """Open every source (schemas, token ids, images) and encode its first ``limit``
    records: what a run would fail on, checked cheaply before it starts. Errors name the
    flag and the file (and line or row)."""
    spec = format_spec(config.data)
    fmt = build_format(config, tokenizer)
    splits = ["train"] + (["validation"] if config.validation.interval else [])
    for split in splits:
        found = open_split(config, tokenizer, split, spec.builtin, spec.opened)
        for source, flag in zip(found.sources, found.flags, strict=True):
            try:
                check_fields(source, fmt)
                count = min(limit, source.num_records or limit)
                kept = [fmt.encode(source.record(i), source.where(i))[0] for i in range(count)]
                if all(sample is None for sample in kept):
                    raise RecordError(f"{source.name}: {nothing_to_train(count)}")
            except ValueError as error:
                raise ValueError(f"{flag}: {error}") from None


def nothing_to_train(count: int) -> str:
    return (
        f"nothing to train on: none of the {count} records checked keeps a trained token (no "
        "assistant turn, every label masked, or too long for training.seq_len)"
    )


@register_rule
def check_data_config(config: Config, world_size: int) -> None:
    """Data and validation fields that only make sense together."""
    data, validation = config.data, config.validation
    if data.format not in FORMATS.names():
        raise ConfigError(
            f"data.format {data.format!r} is not a registered format; registered: "
            f"{', '.join(FORMATS.names())}"
        )
    if data.sources and data.path is not None:
        raise ConfigError("data.sources and data.path are both set: give one")
    for i, source in enumerate(data.sources):
        if not source.path:
            raise ConfigError(f"data.sources.{i}.path is empty")
        if not source.weight > 0:
            raise ConfigError(f"data.sources.{i}.weight must be > 0, got {source.weight}")
    limits = ("data.template_timeout_s", "data.max_template_chars", "data.max_record_bytes")
    limits += ("data.pack_buffer",)
    check_positive(config, *limits)
    if data.isolate_documents and data.format != "text":
        raise ConfigError(
            "data.isolate_documents is for data.format text (sft packing always isolates)"
        )
    if validation.interval < 0:
        raise ConfigError(f"validation.interval must be >= 0, got {validation.interval}")
    if validation.steps < 1:
        raise ConfigError(f"validation.steps must be >= 1, got {validation.steps}")
    if not 0.0 <= validation.fraction < 1.0:
        raise ConfigError(f"validation.fraction must be in [0, 1), got {validation.fraction}")
    if validation.fraction and validation.path is not None:
        raise ConfigError("validation.fraction and validation.path are both set: give one")
    if validation.fraction and not configured_sources(data):
        raise ConfigError(
            "validation.fraction holds out records of data.path or data.sources; the built-in "
            "tasks validate on their own held-out split"
        )
    if validation.generate < 0 or validation.max_new_tokens < 1:
        raise ConfigError("validation.generate must be >= 0 and validation.max_new_tokens >= 1")
    if validation.generate and data.format not in ("sft", "prompt"):
        raise ConfigError(
            f"validation.generate answers held-out prompts of sft or prompt data, not "
            f"data.format {data.format}"
        )
    if validation.generate and is_image_data(data):
        raise ConfigError(
            "validation.generate answers text prompts; this sft data holds images (keep "
            "validation.interval for the held-out loss)"
        )
    if validation.interval and data.format == "prompt" and not validation.generate:
        raise ConfigError(
            "validation.interval: prompt data (grpo) has no loss on fixed batches; set "
            "validation.generate to check greedy answers to held-out prompts"
        )
