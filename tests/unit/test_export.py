"""Exports that serve as is: the checkpoint carries its tokenizer and chat template,
`dcp-to-hf` writes the stop and pad ids so transformers' `generate` stops where Temper's
does, and `--adapter-only` writes a PEFT adapter that reproduces Temper's LoRA forward."""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from temper.checkpoint.convert import dcp_to_hf, hf_to_dcp, main
from temper.config import load_config
from temper.data.chat import BUILTIN_TEMPLATE, render_chat, stop_token_ids
from temper.engine import Engine
from temper.generation import generate
from temper.models.lora import lora_modules
from temper.utils.device import Runtime

MESSAGES = [{"role": "user", "content": "copy: a b c"}]
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"


def one_process() -> Runtime:
    return Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def tiny_hf_folder(folder: Path, template: str | None = None) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=768,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    shutil.copy(resources.files("temper.assets") / "tokenizer.json", folder / "tokenizer.json")
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    if template is not None:
        tokenizer_config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


def test_sft_export_stops_where_temper_stops(tmp_path: Path) -> None:
    config = load_config(
        "temper.recipes.posttrain",
        "sft_debug",
        ["--job.dump_folder", str(tmp_path / "run"), "--checkpoint.enable"],
    )
    engine = Engine(config, one_process())
    tokenizer, model = engine.tokenizer, engine.model.eval()
    prompt = tokenizer.encode(render_chat(BUILTIN_TEMPLATE, MESSAGES, add_generation_prompt=True))
    stops = stop_token_ids(tokenizer, BUILTIN_TEMPLATE)
    end = tokenizer.encode("<|end|>")[0]
    assert stops == {tokenizer.eos_id, end}
    # A random model never ends a turn: make it say <|end|> where it would say its 4th token.
    with torch.no_grad():
        free = generate(model, [prompt], max_new_tokens=4).tokens[0].tolist()
        model.output.weight[end] = 2 * model.output.weight[free[3]]
        ours = generate(model, [prompt], max_new_tokens=16, stop_tokens=stops)
    length = int(ours.lengths[0])
    reply = ours.tokens[0, :length].tolist()
    assert length < 16 and reply[-1] == end
    engine.save(1, wait=True)
    out = tmp_path / "hf"
    dcp_to_hf(tmp_path / "run" / "checkpoints" / "step-1", out)

    hf_tokenizer = AutoTokenizer.from_pretrained(out)
    encoded = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert list(encoded["input_ids"]) == prompt  # the chat template came with the export
    assert hf_tokenizer.eos_token == "<|end|>" and hf_tokenizer.pad_token == "<|pad|>"
    hf_model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf_model.config.eos_token_id == end
    assert hf_model.config.pad_token_id == tokenizer.pad_id
    assert sorted(hf_model.generation_config.eos_token_id) == sorted(stops)
    with torch.no_grad():
        theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    assert theirs[0, len(prompt) :].tolist() == reply


def test_the_checkpoint_exports_without_its_tokenizer_folder(tmp_path: Path) -> None:
    hf = tiny_hf_folder(tmp_path / "base", template=TEMPLATE)
    hf_to_dcp(hf, tmp_path / "ckpt")
    shutil.rmtree(hf)  # the checkpoint alone must be enough
    args = ["--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out")]
    assert main(["dcp-to-hf", *args]) == 0
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert text == render_chat(TEMPLATE, MESSAGES)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert config["pad_token_id"] == tokenizer.convert_tokens_to_ids("<|pad|>")


def test_adapter_only_export_loads_in_peft(tmp_path: Path) -> None:
    peft = pytest.importorskip(
        "peft", reason="peft (the dev extra's test-only dependency) is not installed"
    )
    hf = tiny_hf_folder(tmp_path / "base")
    config = load_config(
        "temper.recipes.llama3",
        "llama3_debug",
        [
            "--model.hf_path", str(hf),
            "--job.dump_folder", str(tmp_path / "run"),
            "--checkpoint.enable",
            "--lora.enable",
            "--lora.rank", "4",
            "--lora.alpha", "12",
            "--lora.target_modules", "q_proj", "v_proj", "down_proj",
        ],
    )  # fmt: skip
    engine = Engine(config, one_process())
    with torch.no_grad():
        for module in lora_modules(engine.model):
            module.lora_b.normal_(std=0.1)  # as after training: the adapters change the output
    engine.save(1, wait=True)
    out = tmp_path / "adapter"
    dcp_to_hf(tmp_path / "run" / "checkpoints" / "step-1", out, adapter_only=True)
    assert {p.name for p in out.iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
        "checksums.sha256",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    # PEFT's own short names, not one full name per layer.
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    served_tokenizer = AutoTokenizer.from_pretrained(out)  # the folder serves on its own
    assert served_tokenizer("copy: a b c")["input_ids"] == engine.tokenizer.encode("copy: a b c")

    base = AutoModelForCausalLM.from_pretrained(hf).eval()
    ids = torch.randint(0, 768, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = base(ids).logits
        served = peft.PeftModel.from_pretrained(base, out).eval()
        theirs = served(ids).logits
        ours = engine.model.eval()(ids)
    assert (ours - base_logits).abs().max() > 1e-2  # the adapters matter
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)


def test_export_keeps_bos_and_the_source_generation_config(tmp_path: Path) -> None:
    """A run started from an HF folder exports its config.json's bos_token_id and its
    generation_config.json's sampling defaults, with the run's own stop ids."""
    hf = tiny_hf_folder(tmp_path / "base")
    config = json.loads((hf / "config.json").read_text())
    config["bos_token_id"] = 5
    (hf / "config.json").write_text(json.dumps(config))
    source = {"bos_token_id": 5, "do_sample": True, "temperature": 0.6, "top_p": 0.95}
    (hf / "generation_config.json").write_text(json.dumps(source))
    hf_to_dcp(hf, tmp_path / "ckpt")
    dcp_to_hf(tmp_path / "ckpt", tmp_path / "out")

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert exported.config.bos_token_id == 5
    generation = exported.generation_config
    assert (generation.do_sample, generation.temperature, generation.top_p) == (True, 0.6, 0.95)
    assert generation.bos_token_id == 5
    eos = AutoTokenizer.from_pretrained(tmp_path / "out").convert_tokens_to_ids("<|endoftext|>")
    assert generation.eos_token_id == eos  # the run's stop id, as before


def test_hf_export_final_writes_the_trained_model(tmp_path: Path) -> None:
    from temper.trainer.trainer import Trainer

    config = load_config(
        "temper.recipes.llama3",
        "llama3_debug",
        [
            "--training.steps", "2",
            "--training.seq_len", "16",
            "--training.local_batch_size", "2",
            "--job.dump_folder", str(tmp_path),
            "--checkpoint.enable",
            "--checkpoint.interval", "1",
            "--checkpoint.hf_export", "final",
            "--metrics.no-tensorboard",
        ],
    )  # fmt: skip
    trainer = Trainer(config, one_process())
    trainer.train()
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["step-2"]  # final only
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "step-2").eval()
    ids = torch.randint(0, 688, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = trainer.engine.model.eval()(ids)
        theirs = exported(ids).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def test_hf_export_needs_checkpoints() -> None:
    from temper.config import ConfigError

    with pytest.raises(ConfigError, match="checkpoint.hf_export every exports checkpoints"):
        load_config("temper.recipes.llama3", "llama3_debug", ["--checkpoint.hf_export", "every"])


def test_a_peft_adapter_starts_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An adapter exported with --adapter-only starts a new run's adapters: its logits are
    the trained run's; an adapter of another rank is refused before launch."""
    from temper.train import main as train_main

    hf = tiny_hf_folder(tmp_path / "base")
    common = ["--model.hf_path", str(hf), "--checkpoint.enable", "--lora.enable"]
    common += ["--lora.rank", "4", "--lora.target_modules", "q_proj", "v_proj"]
    first = Engine(
        load_config(
            "temper.recipes.llama3",
            "llama3_debug",
            [*common, "--job.dump_folder", str(tmp_path / "a")],
        ),
        one_process(),
    )
    with torch.no_grad():
        for module in lora_modules(first.model):
            module.lora_b.normal_(std=0.1)
    first.save(1, wait=True)
    adapter = tmp_path / "adapter"
    dcp_to_hf(tmp_path / "a" / "checkpoints" / "step-1", adapter, adapter_only=True)

    start = [
        *common,
        "--lora.initial_adapter",
        str(adapter),
        "--job.dump_folder",
        str(tmp_path / "b"),
    ]
    second = Engine(load_config("temper.recipes.llama3", "llama3_debug", start), one_process())
    ids = torch.randint(0, 768, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(second.model(ids), first.model(ids), atol=0, rtol=0)

    capsys.readouterr()
    assert train_main(["--check_only", *start, "--lora.rank", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"temper: config error: lora.initial_adapter {adapter}: {adapter}: r is 4, the run's is 2"
    )
