"""HF conversion, separate from training.

    python -m temper.checkpoint.convert dcp-to-hf --checkpoint run/checkpoints/step-100 --output out
    python -m temper.checkpoint.convert hf-to-dcp --hf /models/Qwen3-0.6B --output ckpt/qwen3-0.6b

`dcp-to-hf` reads the model's shape from the checkpoint's `temper.json` and streams its
weights (from any number of ranks' shards, LoRA merged) one tensor at a time into
safetensors shards, then writes `config.json` and the tokenizer files and chat template the
checkpoint carries (`--adapter-only`: a LoRA run's adapters as a PEFT folder). `hf-to-dcp`
streams an HF folder the other way into a weights-only checkpoint that a run can start from
with `--checkpoint.initial_load`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from temper.checkpoint.adapter import save_peft_adapter
from temper.checkpoint.integrity import sha256_of
from temper.checkpoint.manager import CheckpointManager, check_intact, write_checkpoint
from temper.checkpoint.metadata import (
    METADATA_FILE,
    build_metadata,
    read_metadata,
    run_structure,
)
from temper.checkpoint.reader import read_dcp_metadata
from temper.checkpoint.streaming import (
    MODEL_PREFIX,
    checkpoint_meta_model,
    hf_tensor_plan,
    load_adapters,
    streamed_hf_tensors,
)
from temper.checkpoint.tokenizer_files import (
    CHAT_TEMPLATE_FILE,
    TOKENIZER_FOLDER,
    checkpoint_tokenizer,
    exported_tokenizer,
    tokenizer_files,
)
from temper.data.chat import load_chat_template, stop_token_ids
from temper.data.tokenizer import Tokenizer, load_tokenizer
from temper.models import load_hf, materialize, save_hf
from temper.models.hf import (
    build_hf_model,
    carried_tensors,
    hf_weight_readers,
    write_hf_config,
)
from temper.models.lora import lora_modules, merge_lora
from temper.models.safetensors_io import (
    DEFAULT_SHARD_BYTES,
    read_json,
    write_safetensors_streaming,
)
from temper.quantize import quantize_lora_base, write_quantization
from temper.quantize.nf4 import RowShardedNF4Planner
from temper.utils.paths import inside

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
    """The model a checkpoint describes, with its weights, on the CPU, LoRA adapters merged
    into their base weights (W + scale * B A, as the HF folder holds them)."""
    model = materialize(checkpoint_meta_model(checkpoint), "cpu")
    planner = None
    if _nf4_base(read_metadata(checkpoint)):
        # The checkpoint holds NF4 codes and scales, split in rows where FSDP2 saved them.
        shards = _nf4_row_shards(checkpoint, model)
        quantize_lora_base(model, shards)
        planner = RowShardedNF4Planner()
    manager = CheckpointManager(checkpoint.parent, keep_latest_k=0, async_mode=False)
    manager.load(checkpoint, {"model": get_model_state_dict(model)}, planner)
    return merge_lora(model)


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
        tokenizer = load_tokenizer(checkpoint_tokenizer(checkpoint, read_metadata(checkpoint)))
    if tokenizer.vocab_size > model.args.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, the model only "
            f"{model.args.vocab_size}: they do not belong together"
        )
    return model, tokenizer


def dcp_to_hf(
    checkpoint: Path,
    output: Path,
    dtype: str | None = None,
    adapter_only: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    tokenizer: Path | None = None,
) -> None:
    """Write an HF folder that serves as is: weights, config.json, the checkpoint's tokenizer
    files (or `tokenizer`'s) and chat template, the token ids a server stops and pads with
    (for a chat run the end-of-turn token, so ``generate`` stops where the assistant's turn
    ends), and ``checksums.sha256`` of every file. With ``adapter_only``, only a LoRA run's
    adapters, as a PEFT folder. Every byte of the checkpoint is verified first."""
    check_intact(checkpoint)
    metadata = read_metadata(checkpoint)
    recorded = [metadata.get(k) for k in ("tokenizer", "tokenizer_source", "hf_path")]
    check_output(output, [checkpoint, *(Path(p) for p in recorded if p)])
    lora = metadata["structure"].get("lora")
    if adapter_only and not lora:
        raise ValueError(f"--adapter-only: {checkpoint} was not trained with LoRA")
    source = exported_tokenizer(checkpoint, metadata, tokenizer)
    tokenizer = load_tokenizer(source)
    files = {
        name.removeprefix(f"{TOKENIZER_FOLDER}/"): text
        for name, text in tokenizer_files(source, None).items()
    }
    chat = metadata.get("data_format", "text") != "text"
    template = _chat_template(files, source) if chat else None
    turn_end = _turn_end(tokenizer, template)
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else turn_end
    stops = sorted(stop_token_ids(tokenizer, template)) if template is not None else turn_end
    start = _existing(metadata.get("hf_path"))
    config = json.loads(files["tokenizer_config.json"])
    config["eos_token"] = tokenizer.decode([turn_end])
    config["pad_token"] = tokenizer.decode([pad])
    files["tokenizer_config.json"] = json.dumps(config, indent=2) + "\n"
    if template is not None:
        files[CHAT_TEMPLATE_FILE] = template
    if adapter_only:
        # The adapter folder serves with its tokenizer, as PEFT's save_pretrained beside a
        # tokenizer's does.
        model = load_adapters(checkpoint, checkpoint_meta_model(checkpoint))
        save_peft_adapter(model, lora, output, metadata.get("hf_path"))
        for name, text in files.items():
            (output / name).write_text(text)
        write_checksums(output)
        return
    cast = DTYPES[dtype] if dtype is not None else None
    token_ids = {"eos_token_id": turn_end, "pad_token_id": pad}
    bos = _bos_token_id(tokenizer, start)
    if bos is not None:
        token_ids["bos_token_id"] = bos
    generation = _source_generation_config(start) | {"eos_token_id": stops}
    if _nf4_base(metadata):
        # NF4 codes do not reshard tensor by tensor: the (small) quantized model is loaded
        # whole and merged.
        model = load_checkpoint_model(checkpoint)
        model = model.to(cast) if cast is not None else model
        save_hf(
            model,
            output,
            extra_config=token_ids,
            generation_config=generation,
            max_shard_bytes=max_shard_bytes,
            carry_from=start,
        )
    else:
        model = checkpoint_meta_model(checkpoint)
        plan = hf_tensor_plan(model, cast)
        tensors = streamed_hf_tensors(checkpoint, model, cast)
        carried = carried_tensors(model, start) if start is not None else {}
        plan |= {key: torch.empty_like(t, device="meta") for key, t in carried.items()}
        write_safetensors_streaming(
            output, plan, itertools.chain(tensors, carried.items()), max_shard_bytes
        )
        write_hf_config(
            output,
            model,
            cast or next(model.parameters()).dtype,
            extra_config=token_ids,
            generation_config=generation,
        )
    for name, text in files.items():
        (output / name).write_text(text)
    if metadata.get("qat"):
        write_quantization(output, metadata["qat"])  # load_quantized reads it
    write_checksums(output)


CHECKSUMS_FILE = "checksums.sha256"


def write_checksums(folder: Path) -> None:
    """``checksums.sha256`` beside the files of an export, in ``sha256sum``'s format, so a
    copy can be checked anywhere with ``sha256sum -c checksums.sha256``."""
    lines = [
        f"{sha256_of(path)}  {path.relative_to(folder).as_posix()}\n"
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != CHECKSUMS_FILE
    ]
    (folder / CHECKSUMS_FILE).write_text("".join(lines))


def _nf4_row_shards(checkpoint: Path, model: nn.Module) -> int:
    """The row shards the checkpoint holds each NF4 base in: the FSDP2 degree it was saved
    at, 1 for one process."""
    saved = read_dcp_metadata(checkpoint).state_dict_metadata
    names = {id(m): name for name, m in model.named_modules()}
    keys = [f"{MODEL_PREFIX}{names[id(m)]}.weight" for m in lora_modules(model)]
    return max((len(saved[key].chunks) for key in keys), default=1)


def _nf4_base(metadata: dict) -> bool:
    """A QLoRA run's checkpoint: its adapted layers' base weights are NF4 codes and scales."""
    lora = metadata["structure"].get("lora")
    return bool(lora) and lora.get("quantize_base") == "nf4"


def _existing(folder: str | None) -> str | None:
    """The folder a run started from, where it still exists: the tensors an export carries
    through come from it (a moved folder gives an export without them)."""
    return folder if folder is not None and Path(folder).is_dir() else None


def _bos_token_id(tokenizer: Tokenizer, start: str | None) -> int | None:
    """The BOS id transformers' ``generate`` and servers prepend: the starting folder's
    config.json's, else the tokenizer's ``bos_token``, else none."""
    if start is not None:
        bos = read_json(inside(start, "config.json"), "HF model config").get("bos_token_id")
        if bos is not None:
            return bos
    token = tokenizer.special_tokens.get("bos_token")
    return tokenizer.token_id(token) if token is not None else None


def _source_generation_config(start: str | None) -> dict:
    """The starting folder's generation_config.json (sampling defaults, stop ids), carried
    into the export; {} when the run did not start from one that has it."""
    if start is None or not (Path(start) / "generation_config.json").is_file():
        return {}
    return read_json(inside(start, "generation_config.json"), "generation config")


def _chat_template(files: dict[str, str], source: str | None) -> str | None:
    """The template a chat run's data was rendered with: carried by the checkpoint, else
    (older checkpoints) its tokenizer folder's or the built-in one."""
    if CHAT_TEMPLATE_FILE in files:
        return files[CHAT_TEMPLATE_FILE]
    try:
        return load_chat_template(None, source)
    except ValueError:
        return None


def _turn_end(tokenizer: Tokenizer, template: str | None) -> int:
    """The token a reply ends with: the template's end-of-turn token, else EOS."""
    if template is None:
        return tokenizer.eos_id
    others = stop_token_ids(tokenizer, template) - {tokenizer.eos_id}
    return min(others) if others else tokenizer.eos_id


def hf_to_dcp(hf: Path, output: Path) -> None:
    """A weights-only checkpoint of an HF folder, streamed: the model only on meta, each
    tensor read from the safetensors (experts stacked, in fp32) when DCP writes it."""
    check_output(output, [hf])
    model = build_hf_model(hf)
    readers = hf_weight_readers(model, hf)
    metadata = build_metadata(
        model,
        step=0,
        structure=run_structure(ep=1, lora=None, param_dtype=torch.float32),
        extra={"tokenizer_source": str(hf.resolve()), "hf_path": str(hf.resolve())},
    )
    state = {"model": get_model_state_dict(model)}
    write_checkpoint(
        output,
        state,
        metadata,
        files=tokenizer_files(str(hf), None),
        produce=lambda name: readers[name.removeprefix(MODEL_PREFIX)](),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m temper.checkpoint.convert")
    commands = parser.add_subparsers(dest="command", required=True)
    to_hf = commands.add_parser("dcp-to-hf", help="a temper checkpoint -> an HF folder")
    to_hf.add_argument("--checkpoint", type=Path, required=True, help="a step-<N> folder")
    to_hf.add_argument("--output", type=Path, required=True)
    to_hf.add_argument(
        "--dtype", choices=sorted(DTYPES), help="cast the weights (default: as saved)"
    )
    to_hf.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA run: write only its adapters as a PEFT folder (adapter_config.json, "
        "adapter_model.safetensors) for the base model's HF folder",
    )
    to_hf.add_argument(
        "--tokenizer",
        type=Path,
        help="ship this tokenizer (folder or tokenizer.json) instead of the checkpoint's own "
        "files; needed only for a checkpoint that carries none",
    )
    to_hf.add_argument(
        "--max-shard-gib",
        type=float,
        default=DEFAULT_SHARD_BYTES / 2**30,
        help="largest safetensors file; memory peaks near twice this (default: %(default)s)",
    )
    from_hf = commands.add_parser("hf-to-dcp", help="an HF folder -> a weights-only checkpoint")
    from_hf.add_argument("--hf", type=Path, required=True, help="a local HF model folder")
    from_hf.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "dcp-to-hf":
            shard_bytes = int(args.max_shard_gib * 2**30)
            dcp_to_hf(
                args.checkpoint,
                args.output,
                args.dtype,
                args.adapter_only,
                shard_bytes,
                args.tokenizer,
            )
        else:
            hf_to_dcp(args.hf, args.output)
    except (OutputRefused, FileNotFoundError, ValueError) as err:
        print(f"temper convert: {err}", file=sys.stderr)
        return 2
    print(f"temper convert: wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
