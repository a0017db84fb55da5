"""HF conversion, separate from training.

    python -m temper.checkpoint.convert dcp-to-hf --checkpoint run/checkpoints/step-100 --output out
    python -m temper.checkpoint.convert hf-to-dcp --hf /models/Qwen3-0.6B --output ckpt/qwen3-0.6b

`dcp-to-hf` rebuilds the model from the checkpoint's `temper.json`, loads its weights
(from any number of ranks' shards) and writes safetensors, `config.json` and the
tokenizer files. `hf-to-dcp` writes a weights-only checkpoint that a run can start
from with `--checkpoint.initial_load`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from temper.checkpoint.manager import CheckpointManager, write_checkpoint
from temper.checkpoint.metadata import (
    METADATA_FILE,
    build_metadata,
    read_metadata,
    run_structure,
)
from temper.data.tokenizer import Tokenizer, load_tokenizer
from temper.models import get_model_spec, load_hf, materialize, save_hf
from temper.models.lora import apply_lora, merge_lora

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class OutputRefused(ValueError):
    """The output folder would overwrite or mix with a source."""


def check_output(output: Path, sources: Sequence[Path]) -> None:
    """Refuse an output that equals, contains or lies inside a source, or holds a checkpoint."""
    out = output.resolve()
    for source in sources:
        src = source.resolve()
        if out == src:
            raise OutputRefused(f"--output {output} is the source folder {source}")
        if src.is_relative_to(out):
            raise OutputRefused(f"--output {output} contains the source folder {source}")
        if out.is_relative_to(src):
            raise OutputRefused(f"--output {output} lies inside the source folder {source}")
    if (out / METADATA_FILE).exists() or (out / ".metadata").exists():
        raise OutputRefused(
            f"--output {output} already holds checkpoint state; choose a new folder"
        )


def load_checkpoint_model(checkpoint: Path) -> nn.Module:
    """The model a checkpoint describes, with its weights, on the CPU."""
    metadata = read_metadata(checkpoint)
    spec = get_model_spec(metadata["model"]["family"])
    args = spec.hf_adapter.args_from_hf(metadata["model"]["hf_config"])
    with torch.device("meta"):
        model = spec.model_cls(args)
    lora = metadata["structure"].get("lora")
    if lora:
        apply_lora(
            model,
            lora["target_modules"],
            rank=lora["rank"],
            alpha=lora["alpha"],
            rslora=lora["rslora"],
        )
    materialize(model, "cpu")
    manager = CheckpointManager(checkpoint.parent, keep_latest_k=0, async_mode=False)
    manager.load(checkpoint, {"model": get_model_state_dict(model)})
    # LoRA is merged on export: the HF folder holds plain weights W + scale * B A.
    return merge_lora(model) if lora else model


def load_for_inference(
    hf: Path | None, checkpoint: Path | None, device: torch.device, dtype: torch.dtype
) -> tuple[nn.Module, Tokenizer]:
    """A model and its tokenizer from an HF folder or a checkpoint (whose ``temper.json``
    names the tokenizer; the built-in one when it names none), refusing a mismatched pair."""
    if hf is not None:
        model = load_hf(hf, dtype=dtype, device=device)
        tokenizer = load_tokenizer(str(hf))
    else:
        model = load_checkpoint_model(checkpoint).to(device=device, dtype=dtype)
        tokenizer = load_tokenizer(read_metadata(checkpoint).get("tokenizer"))
    if tokenizer.vocab_size > model.args.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, the model only "
            f"{model.args.vocab_size}: they do not belong together"
        )
    return model, tokenizer


def dcp_to_hf(checkpoint: Path, output: Path, dtype: str | None = None) -> None:
    metadata = read_metadata(checkpoint)
    tokenizer_source = metadata.get("tokenizer")
    sources = [checkpoint] + ([Path(tokenizer_source)] if tokenizer_source else [])
    if metadata.get("hf_path"):
        sources.append(Path(metadata["hf_path"]))
    check_output(output, sources)
    model = load_checkpoint_model(checkpoint)
    if dtype is not None:
        model = model.to(DTYPES[dtype])
    tokenizer = load_tokenizer(tokenizer_source)
    save_hf(model, output, extra_config={"eos_token_id": tokenizer.eos_id})
    _write_tokenizer_files(tokenizer_source, output, tokenizer)


def hf_to_dcp(hf: Path, output: Path) -> None:
    check_output(output, [hf])
    model = load_hf(hf)
    metadata = build_metadata(
        model,
        step=0,
        structure=run_structure(ep=1, lora=None, param_dtype=torch.float32),
        extra={"tokenizer": str(hf.resolve()), "hf_path": str(hf.resolve())},
    )
    write_checkpoint(output, {"model": get_model_state_dict(model)}, metadata)


def _write_tokenizer_files(source: str | None, output: Path, tokenizer) -> None:
    if source is None:
        builtin = resources.files("temper.assets") / "tokenizer.json"
        shutil.copy(builtin, output / "tokenizer.json")
        eos = tokenizer.decode([tokenizer.eos_id])
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}
        if tokenizer.pad_id is not None:
            config["pad_token"] = tokenizer.decode([tokenizer.pad_id])
        (output / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return
    folder = Path(source)
    if folder.is_file():
        shutil.copy(folder, output / "tokenizer.json")
        return
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copy(folder / name, output / name)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m temper.checkpoint.convert")
    commands = parser.add_subparsers(dest="command", required=True)
    to_hf = commands.add_parser("dcp-to-hf", help="a temper checkpoint -> an HF folder")
    to_hf.add_argument("--checkpoint", type=Path, required=True, help="a step-<N> folder")
    to_hf.add_argument("--output", type=Path, required=True)
    to_hf.add_argument(
        "--dtype", choices=sorted(DTYPES), help="cast the weights (default: as saved)"
    )
    from_hf = commands.add_parser("hf-to-dcp", help="an HF folder -> a weights-only checkpoint")
    from_hf.add_argument("--hf", type=Path, required=True, help="a local HF model folder")
    from_hf.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "dcp-to-hf":
            dcp_to_hf(args.checkpoint, args.output, args.dtype)
        else:
            hf_to_dcp(args.hf, args.output)
    except (OutputRefused, FileNotFoundError, ValueError) as err:
        print(f"temper convert: {err}", file=sys.stderr)
        return 2
    print(f"temper convert: wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
