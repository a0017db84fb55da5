"""Pre-flight: every input a run would fail on that needs no process group, checked once
before any rank starts (``python -m temper.train --check_only``, which ``run_train.sh``
runs before torchrun). A failure is one ConfigError naming the flag, file and line."""

from __future__ import annotations

import tempfile
from pathlib import Path

from temper.config import Config, ConfigError
from temper.data.chat import TemplateLimits, load_chat_template, render_chat
from temper.data.loader import check_data
from temper.data.tokenizer import Tokenizer
from temper.engine import build_run_model, load_run_tokenizer
from temper.engine.checkpointing import TrainCheckpointer
from temper.engine.engine import read_initial_adapter
from temper.models.hf import check_hf_weights
from temper.trainer.loggers import check_loggers
from temper.trainer.positions import check_positions
from temper.trainer.run_lock import check_run_folder_free

PREFLIGHT_RECORDS = 100
"""Records of each data file parsed before launch: the format's mistakes show in the first
lines, and a large corpus is not read twice."""


def preflight(config: Config) -> None:
    """Raise ConfigError on the first bad input: an unwritable ``job.dump_folder``, a missing
    chat template or one that fails to render, data sources that are missing, lack a field,
    hold token ids beyond the vocabulary, or whose first records do not parse or give
    nothing to train on, a tokenizer larger than the model's vocabulary, an HF folder whose
    shard headers, tensor names, shapes or dtypes do not fit the model, or that names a file
    outside itself, LoRA targets that match nothing (on the meta model), a checkpoint to
    resume or ``initial_load`` of another model."""
    check_writable(config.job.dump_folder)
    check_loggers(config)
    check_run_folder_free(config.job.dump_folder)
    check_positions(config)
    tokenizer = load_run_tokenizer(config)
    if config.data.format != "text":
        check_chat_template(config, tokenizer)
    try:
        check_data(config, tokenizer, PREFLIGHT_RECORDS)
    except (OSError, ValueError) as error:
        raise ConfigError(str(error)) from None
    model = build_run_model(config, tokenizer)
    if config.model.hf_path is not None:
        try:
            check_hf_weights(model, config.model.hf_path)
        except (OSError, ValueError) as error:
            raise ConfigError(f"model.hf_path {config.model.hf_path}: {error}") from None
    if config.lora.enable and config.lora.initial_adapter is not None:
        read_initial_adapter(model, config.lora)
    try:
        TrainCheckpointer(config).check(model, digests=False)
    except ConfigError:
        raise
    except (OSError, ValueError) as error:
        raise ConfigError(f"checkpoint: {error}") from None


def check_chat_template(config: Config, tokenizer: Tokenizer) -> None:
    """The run's chat template loads (from inside its folder) and renders a one-question
    prompt within ``data.template_timeout_s`` and ``data.max_template_chars``: a template the
    sandbox refuses is named here, as the template, before any record."""
    data = config.data
    folder = data.tokenizer_path or config.model.hf_path
    where = data.chat_template or (f"(the template of {folder})" if folder else "(built-in)")
    try:
        template = load_chat_template(data.chat_template, folder)
        question = [{"role": "user", "content": "hi"}]
        limits = TemplateLimits.of(data)
        render_chat(template, question, True, limits=limits, **tokenizer.special_tokens)
    except (OSError, ValueError) as error:
        raise ConfigError(f"data.chat_template {where}: {error}") from None


def check_writable(folder: str) -> None:
    """``folder`` exists (created if needed) and a file can be written in it."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise ConfigError(
            f"job.dump_folder {folder}: not writable ({error.strerror or error})"
        ) from None
