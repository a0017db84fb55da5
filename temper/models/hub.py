"""Models by Hugging Face repository id: ``--model.hf_path Qwen/Qwen3-8B`` names the
repository's snapshot in huggingface_hub's local cache (``HF_HUB_CACHE``, by default
``~/.cache/huggingface/hub``); the network is used only when ``model.allow_download`` says
so. A snapshot's files are links into the repository's ``blobs/``, which the folder rules of
`temper.utils.paths` allow and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

from temper.config import Config, ConfigError, register_rule

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""``owner/name``, as the hub spells repositories: one slash, no leading ``/`` or ``.``."""
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]
"""What a download fetches: configs, weights, tokenizer files and templates (no other
formats' copies of the weights)."""


def resolve_hf_path(path: str, allow_download: bool) -> str:
    """The folder ``model.hf_path`` names: itself when it exists or is no repository id,
    else the id's snapshot in the local cache, downloaded first only with ``allow_download``
    (ConfigError naming the field otherwise)."""
    if Path(path).exists() or not REPO_ID.match(path):
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(path, local_files_only=True)
    except LocalEntryNotFoundError:
        if not allow_download:
            raise ConfigError(
                f"model.hf_path {path}: no such folder, and the repository is not in the "
                f"Hugging Face cache ({constants.HF_HUB_CACHE}); --model.allow_download "
                f"downloads it, or `hf download {path}` first"
            ) from None
    try:
        return snapshot_download(path, allow_patterns=HUB_FILES)
    except (OSError, ValueError) as error:  # the hub's HTTP errors are OSErrors
        raise ConfigError(f"model.hf_path {path}: download failed: {error}") from None


@register_rule
def resolve_model_id(config: Config, world_size: int) -> None:
    """Replace a repository id in ``model.hf_path`` by its snapshot folder, once, before the
    builders and the later rules (the optimizer's) read the folder; the rules registered
    before this one do not read it."""
    if config.model.hf_path is not None:
        config.model.hf_path = resolve_hf_path(config.model.hf_path, config.model.allow_download)
