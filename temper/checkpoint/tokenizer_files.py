"""The tokenizer files a checkpoint carries (``<step>/tokenizer/``), so it can be resumed,
evaluated and exported after the folder it was trained with is gone, and the chat template
its chat data was rendered with goes to the export."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from temper.data.tokenizer import load_tokenizer

TOKENIZER_FOLDER = "tokenizer"
"""The checkpoint's subfolder that holds them."""
CHAT_TEMPLATE_FILE = "chat_template.jinja"
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)
"""A vision-language folder's image (and video) processor settings, which its export needs."""
COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    CHAT_TEMPLATE_FILE,
    *PROCESSOR_FILES,
)


def tokenizer_files(source: str | None, chat_template: str | None) -> dict[str, str]:
    """Name -> text of the files that rebuild the run's tokenizer: ``source``'s (an HF
    folder, a ``tokenizer.json``, or None for the built-in one), with a
    ``tokenizer_config.json`` naming its EOS and pad tokens where the source has none, and
    ``chat_template`` (the template a chat run rendered its data with) as
    ``chat_template.jinja``. A folder without a ``tokenizer.json`` (weights only) gives none."""
    files: dict[str, str] = {}
    if (
        source is not None
        and Path(source).is_dir()
        and not (Path(source) / "tokenizer.json").is_file()
    ):
        return files
    if source is None:
        files["tokenizer.json"] = (
            resources.files("temper.assets").joinpath("tokenizer.json").read_text()
        )
    elif Path(source).is_file():
        files["tokenizer.json"] = Path(source).read_text()
    else:
        for name in COPIED:
            if (Path(source) / name).is_file():
                files[name] = (Path(source) / name).read_text()
    if "tokenizer_config.json" not in files:
        tokenizer = load_tokenizer(source)
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": tokenizer.decode([tokenizer.eos_id]),
        }
        if tokenizer.pad_id is not None:
            config["pad_token"] = tokenizer.decode([tokenizer.pad_id])
        files["tokenizer_config.json"] = json.dumps(config, indent=2) + "\n"
    if chat_template is not None:
        files[CHAT_TEMPLATE_FILE] = chat_template
    return {f"{TOKENIZER_FOLDER}/{name}": text for name, text in files.items()}


def exported_tokenizer(
    checkpoint: Path, metadata: dict[str, Any], chosen: Path | None
) -> str | None:
    """The tokenizer an export copies: `chosen` (the user's ``--tokenizer``), else the
    checkpoint's own files, else the built-in one when the run used it. A checkpoint that
    predates carried tokenizer files names its tokenizer by a path outside itself, and an
    export never copies a file from outside the checkpoint unless the user says so."""
    if chosen is not None:
        return str(chosen)
    source = checkpoint_tokenizer(checkpoint, metadata)
    if source is not None and Path(source) != checkpoint / TOKENIZER_FOLDER:
        raise ValueError(
            f"{checkpoint} carries no tokenizer files; its temper.json names {source}, outside "
            f"it, and an export copies nothing from outside the checkpoint: pass --tokenizer "
            f"{source} if that is the one to ship"
        )
    return source


def checkpoint_tokenizer(checkpoint: Path, metadata: dict[str, Any]) -> str | None:
    """The folder of a checkpoint's own tokenizer files; for a checkpoint written before
    they were carried, the tokenizer path its ``temper.json`` names (None: the built-in)."""
    folder = checkpoint / TOKENIZER_FOLDER
    if (folder / "tokenizer.json").is_file():
        return str(folder)
    return metadata.get("tokenizer")
