"""Exact-match accuracy by greedy decoding, on the built-in tasks' held-out prompts or on a
prompt JSONL file (``{"prompt": ..., "answer": ...}`` per line, as GRPO reads).

    python scripts/evaluate.py --checkpoint outputs/sft_debug/checkpoints/step-60
    python scripts/evaluate.py --hf exports/run --data prompts.jsonl --chat-template t.jinja
    python scripts/evaluate.py --hf exports/run --engine vllm

A prompt is rendered with the chat template (the file given, else the tokenizer folder's,
else the built-in one) and its generation prompt; the greedy answer, up to the template's
end-of-turn token, must equal the reference answer (outer whitespace aside). Prints the
accuracy and a few answers. ``--engine vllm`` answers with the rollout engine GRPO samples
with: a vLLM server started from scripts/setup_vllm.sh's virtualenv (or --vllm-python's),
or the one at --vllm-url, given the model's weights (docs/generation.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from temper.checkpoint.convert import load_for_inference
from temper.data.chat import load_chat_template, render_chat, stop_token_ids
from temper.data.prompts import read_prompt_records
from temper.data.tasks import task_prompts
from temper.generation.engines import NativeEngine, RolloutEngine
from temper.generation.engines.vllm import VLLMSettings, start_vllm
from temper.generation.evaluate import engine_answers
from temper.models.hf import hf_named_tensors
from temper.objectives.rewards import exact_match
from temper.utils.device import resolve_dtype


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/evaluate.py", description=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", type=Path, help="an HF model folder (with tokenizer files)")
    source.add_argument("--checkpoint", type=Path, help="a temper step-<N> checkpoint folder")
    parser.add_argument("--data", help="prompt JSONL; default: the built-in tasks' eval split")
    parser.add_argument("--count", type=int, default=256, help="built-in prompts to score")
    parser.add_argument("--seed", type=int, default=0, help="the built-in tasks' seed")
    parser.add_argument("--chat-template", help="a Jinja chat template file")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--show", type=int, default=5, help="answers to print")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    parser.add_argument(
        "--engine", choices=("native", "vllm"), default="native", help="what decodes"
    )
    parser.add_argument("--vllm-url", help="--engine vllm: a running server (else one starts)")
    parser.add_argument("--vllm-python", help="--engine vllm: the interpreter to start it with")
    args = parser.parse_args(argv)
    if args.engine != "vllm" and (args.vllm_url or args.vllm_python):
        parser.error("--vllm-url and --vllm-python need --engine vllm")

    device = torch.device(args.device)
    try:
        records = (
            read_prompt_records(args.data)
            if args.data
            else task_prompts(args.seed, "eval", args.count)
        )
        model, tokenizer = load_for_inference(
            args.hf, args.checkpoint, device, resolve_dtype(args.dtype, device)
        )
    except ValueError as err:
        parser.error(str(err))
    folder = str(args.hf) if args.hf is not None else None
    template = load_chat_template(args.chat_template, folder)
    prompts = [
        tokenizer.encode(render_chat(template, messages, True, **tokenizer.special_tokens))
        for messages, _ in records
    ]
    width = max(map(len, prompts)) + args.max_new_tokens
    sampler = build_sampler(args, model, width)
    try:
        answers = engine_answers(
            sampler,
            prompts,
            tokenizer.decode,
            max_new_tokens=args.max_new_tokens,
            stop_tokens=stop_token_ids(tokenizer, template),
        )
    finally:
        sampler.close()
    hits = [exact_match("", got, record) for got, (_, record) in zip(answers, records, strict=True)]
    for (messages, record), got in list(zip(records, answers, strict=True))[: args.show]:
        print(f"{messages[-1]['content']!r} -> {got!r} (answer {record.get('answer', '')!r})")
    print(f"exact match {sum(hits) / len(hits):.4f} ({int(sum(hits))}/{len(hits)})")
    return 0


def build_sampler(args: argparse.Namespace, model: torch.nn.Module, width: int) -> RolloutEngine:
    """The model itself, or a vLLM server given its weights (as a run's ``--rollout.*`` would
    start it; the weights folder lies in /dev/shm, the server's log in the temp folder)."""
    if args.engine == "native":
        return NativeEngine(model)
    tag = f"temper-eval-{os.getpid()}"
    settings = VLLMSettings(
        url=args.vllm_url,
        python=args.vllm_python,
        weights_dir=Path("/dev/shm") / tag,
        bucket_bytes=512 * 2**20,
        max_model_len=width,
        kv_cache_bytes=2**30,
        startup_timeout_s=600.0,
        log=Path(tempfile.gettempdir()) / f"{tag}-vllm.log",
    )
    return start_vllm(settings, model, lambda: hf_named_tensors(model))


if __name__ == "__main__":
    sys.exit(main())
