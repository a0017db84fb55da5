"""Model folders, chat templates and data files are inputs from elsewhere: each path an HF
folder names stays inside it, and each bad input (a lying safetensors header, an integer or
non-finite weight, a template the sandbox refuses or that runs away, an oversized record, chat
data with nothing to train on, a bad record met during the run) ends in one line, exit 2."""

from __future__ import annotations

import json
import re
import shutil
import struct
import tracemalloc
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from temper.data.chat import (
    RecordError,
    TemplateError,
    TemplateLimits,
    load_chat_template,
    read_jsonl,
    render_chat,
)
from temper.data.multimodal import builtin_image_processor, load_image_processor
from temper.data.tokenizer import load_tokenizer
from temper.models import load_hf
from temper.models.hf import read_hf_args
from temper.models.safetensors_io import WeightError
from temper.train import main
from temper.utils.paths import UnsafePath

SFT = ["--module", "temper.recipes.posttrain", "--config", "sft_debug"]
TOKENIZER = resources.files("temper.assets") / "tokenizer.json"
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def tiny_hf_folder(folder: Path, dtype: torch.dtype = torch.float32, shard: str = "") -> Path:
    """A random one-layer Llama saved by transformers, with the built-in tokenizer."""
    config = LlamaConfig(
        vocab_size=768,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    shutil.copy(TOKENIZER, folder / "tokenizer.json")
    return folder


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    """``python -m temper.train`` in this process: its exit code and its ``temper:`` lines
    on stderr (transformers' progress bars and torch's warnings left out)."""
    capsys.readouterr()
    code = main(list(args))
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, [line for line in err.splitlines() if line.startswith("temper:")]


def refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The pre-flight's single line for a bad input, after checking its exit code 2."""
    code, lines = run(capsys, "--check_only", *args)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("temper: config error: ")
    return lines[0]


def symlink_out(link: Path, outside: Path, content: str = "a secret") -> None:
    """``link`` -> a file in ``outside`` (created), replacing what ``link`` was."""
    outside.mkdir(exist_ok=True)
    target = outside / link.name
    target.write_text(content)
    link.unlink(missing_ok=True)
    link.symlink_to(target)


# Confinement: every path a folder names resolves inside it.


def test_an_index_entry_leading_out_of_the_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = tiny_hf_folder(tmp_path / "models" / "hf", shard="100KB")
    index = hf / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    key, shard = next(iter(content["weight_map"].items()))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(
        hf / shard, elsewhere / "model.safetensors"
    )  # a readable file: only the path is wrong
    content["weight_map"][key] = "../../elsewhere/model.safetensors"
    index.write_text(json.dumps(content))
    line = refused(capsys, "--model.hf_path", str(hf))
    assert f"{index}: weight_map[{key!r}] = '../../elsewhere/model.safetensors'" in line
    assert "outside" in line
    with pytest.raises(UnsafePath, match="names a file outside"):
        load_hf(hf)


def test_a_weight_file_linked_out_of_the_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = tiny_hf_folder(tmp_path / "hf")
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(hf / "model.safetensors", outside / "model.safetensors")
    (hf / "model.safetensors").symlink_to(outside / "model.safetensors")
    line = refused(capsys, "--model.hf_path", str(hf))
    assert f"{hf / 'model.safetensors'}: resolves to {outside / 'model.safetensors'}" in line


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_tokenizer_files_linked_out_of_the_folder_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    hf = tiny_hf_folder(tmp_path / "hf")
    outside = tmp_path / "outside"
    symlink_out(hf / name, outside, json.dumps({"eos_token": "<|endoftext|>"}))
    if name == "tokenizer_config.json":  # the real tokenizer.json stays
        shutil.copy(TOKENIZER, hf / "tokenizer.json")
    with pytest.raises(UnsafePath, match=f"{hf / name}: resolves to {outside / name}"):
        load_tokenizer(str(hf))
    line = refused(capsys, "--model.hf_path", str(hf))
    assert f"model.hf_path {hf}: {hf / name}: resolves to {outside / name}" in line


def test_a_chat_template_linked_out_of_the_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(TOKENIZER, folder / "tokenizer.json")
    symlink_out(folder / "chat_template.jinja", tmp_path / "outside", "the secret")
    line = refused(capsys, *SFT, "--data.tokenizer_path", str(folder))
    assert line.startswith(f"temper: config error: data.chat_template (the template of {folder})")
    assert f"{folder / 'chat_template.jinja'}: resolves to" in line
    assert "the secret" not in line
    with pytest.raises(UnsafePath):
        load_chat_template(None, str(folder))


def test_a_processor_config_linked_out_of_the_folder_is_refused(tmp_path: Path) -> None:
    builtin_image_processor().save_pretrained(tmp_path / "vl")
    symlink_out(tmp_path / "vl" / "preprocessor_config.json", tmp_path / "outside", "{}")
    with pytest.raises(UnsafePath, match="preprocessor_config.json: resolves to"):
        load_image_processor(str(tmp_path / "vl"))


def test_a_hub_cache_snapshot_reads_through_its_blob_links(tmp_path: Path) -> None:
    """The hub cache keeps a snapshot's files as links to ``../../blobs``: inside the
    repository's cache folder, so they are read; a link out of that folder is not."""
    built = tiny_hf_folder(tmp_path / "built")
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(built.iterdir())):
        shutil.copy(file, repo / "blobs" / f"blob{i}")
        (snapshot / file.name).symlink_to(Path("../../blobs") / f"blob{i}")
    model = load_hf(snapshot)
    assert load_tokenizer(str(snapshot)).vocab_size == 688
    reference = load_file(built / "model.safetensors")["model.norm.weight"]
    assert torch.equal(model.norm.weight, reference)
    symlink_out(snapshot / "tokenizer.json", tmp_path / "outside")
    with pytest.raises(UnsafePath, match=f"outside {repo}"):
        load_tokenizer(str(snapshot))


# Safetensors headers: checked for every shard before launch.


def edit_header(path: Path, edit: Callable[[dict], None]) -> None:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    edit(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + length :])


def lying_length(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])


def broken_json(path: Path) -> None:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    path.write_bytes(raw[:8] + b"{" + b" " * (length - 1) + raw[8 + length :])


def truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def entry(field: str, value: Callable[[object], object]) -> Callable[[Path], None]:
    def change(header: dict) -> None:
        header[NORM][field] = value(header[NORM][field])

    return lambda path: edit_header(path, change)


NORM = "model.norm.weight"
CORRUPTIONS = {
    "length past the end": (lying_length, "header length"),
    "JSON that does not parse": (broken_json, "header is not valid JSON"),
    "truncated data": (truncated, f"tensor {NORM!r}: data_offsets [233728, 233856] lie outside"),
    "offsets past the data": (
        entry("data_offsets", lambda o: [o[0], o[1] + 10**6]),
        f"tensor {NORM!r}: data_offsets",
    ),
    "size not shape x dtype": (
        entry("shape", lambda s: [s[0] + 1]),
        f"tensor {NORM!r}: 128 bytes declared, but shape [33] of F32 takes 132",
    ),
    "unknown dtype": (entry("dtype", lambda d: "Q9"), f"tensor {NORM!r}: unknown dtype 'Q9'"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_a_bad_safetensors_header_is_one_line_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    hf = tiny_hf_folder(tmp_path / "hf")
    corrupt, expected = CORRUPTIONS[case]
    corrupt(hf / "model.safetensors")
    line = refused(capsys, "--model.hf_path", str(hf))
    assert line.startswith("temper: config error: model.hf_path")
    assert f"{hf / 'model.safetensors'}: {expected}" in line
    with pytest.raises(WeightError, match=re.escape(expected)):
        read_hf_args(hf)


# Weights: integer dtypes refused before launch, non-finite values as they are loaded.


def rewrite_weights(hf: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(hf / "model.safetensors")
    change(tensors)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})


def test_an_integer_weight_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = tiny_hf_folder(tmp_path / "hf")
    rewrite_weights(hf, lambda t: t.update({NORM: t[NORM].to(torch.int64)}))
    line = refused(capsys, "--model.hf_path", str(hf))
    assert f"non-floating tensors for floating parameters: {NORM} is int64" in line
    with pytest.raises(WeightError, match=f"{NORM} is int64"):
        load_hf(hf)


def test_a_bf16_folder_loads_into_an_fp32_model_as_it_is(tmp_path: Path) -> None:
    hf = tiny_hf_folder(tmp_path / "hf", dtype=torch.bfloat16)
    model = load_hf(hf, dtype=torch.float32)
    stored = load_file(hf / "model.safetensors")[NORM]
    assert stored.dtype == torch.bfloat16
    assert model.norm.weight.dtype == torch.float32
    assert torch.equal(model.norm.weight, stored.float())


def test_a_non_finite_weight_stops_the_run_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = tiny_hf_folder(tmp_path / "hf")
    key = "model.layers.0.mlp.up_proj.weight"

    def poison(tensors: dict[str, torch.Tensor]) -> None:
        tensors[key][3, :2] = torch.tensor([float("nan"), float("inf")])

    rewrite_weights(hf, poison)
    with pytest.raises(WeightError, match=f"tensor {key!r} holds 2 non-finite values"):
        load_hf(hf)
    args = ["--model.hf_path", str(hf), "--training.steps", "1", "--training.seq_len", "16"]
    args += ["--metrics.no-tensorboard", "--job.dump_folder", str(tmp_path / "run")]
    assert run(capsys, "--check_only", *args)[0] == 0  # headers are fine; values are read later
    code, lines = run(capsys, *args)
    assert code == 2
    assert lines == [
        f"temper: model error: {hf / 'model.safetensors'}: tensor {key!r} holds 2 non-finite "
        "values (NaN or inf); refused"
    ]


# Chat templates: the sandbox's refusals, and bounds on time and size.


def template_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "template.jinja"
    path.write_text(text)
    return str(path)


def test_a_template_the_sandbox_refuses_is_one_line_and_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "marker"
    escape = "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
    template = template_file(tmp_path, escape)
    line = refused(capsys, *SFT, "--data.chat_template", template)
    assert line.startswith(f"temper: config error: data.chat_template {template}: ")
    assert "SecurityError" in line
    assert not marker.exists()


def test_a_huge_repetition_is_refused_before_it_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    template = "{{ 'a' * 2000000000 }}"
    tracemalloc.start()
    try:
        with pytest.raises(TemplateError, match="over data.max_template_chars"):
            render_chat(template, CHAT)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 * 2**20
    line = refused(capsys, *SFT, "--data.chat_template", template_file(tmp_path, template))
    assert "'a' * 2000000000 would make about 2000000000 characters" in line
    assert f"over data.max_template_chars ({32 * 2**20})" in line


def test_a_doubling_concatenation_is_refused() -> None:
    doubling = (
        "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s }}"
    )
    with pytest.raises(TemplateError, match=r"a '~' would make over .* \(1000\)"):
        render_chat(doubling, CHAT, limits=TemplateLimits(max_chars=1000))


def test_a_template_that_loops_is_stopped_by_its_time_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    forever = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    template = template_file(tmp_path, forever)
    line = refused(
        capsys, *SFT, "--data.chat_template", template, "--data.template_timeout_s", "0.3"
    )
    assert "the chat template ran past data.template_timeout_s (0.3 s); stopped" in line


def test_a_template_output_over_the_limit_is_stopped(tmp_path: Path) -> None:
    flood = "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}"
    with pytest.raises(TemplateError, match=r"wrote over data.max_template_chars \(5000\)"):
        render_chat(flood, CHAT, limits=TemplateLimits(max_chars=5000))


# Data: records over the size limit, chat data with nothing to train on.


def test_a_20_mb_record_is_refused_naming_file_line_and_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "chat.jsonl"
    huge = json.dumps({"messages": [*CHAT[:1], {"role": "assistant", "content": "a" * 20_000_000}]})
    data.write_text(json.dumps({"messages": CHAT}) + "\n" + huge + "\n")
    line = refused(capsys, *SFT, "--data.path", str(data))
    limit = 16 * 2**20
    assert f"{data}:2: the record is longer than data.max_record_bytes ({limit} bytes)" in line


def test_the_record_limit_is_configurable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "docs.jsonl"
    data.write_text('{"text": "short"}\n' + json.dumps({"text": "x" * 200}) + "\n")
    line = refused(capsys, "--data.path", str(data), "--data.max_record_bytes", "100")
    assert f"{data}:2: the record is longer than data.max_record_bytes (100 bytes)" in line


def test_read_jsonl_never_holds_more_than_the_limit(tmp_path: Path) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CHAT}) + "\n" + "[" * 5_000_000 + "\n")
    tracemalloc.start()
    try:
        with pytest.raises(RecordError, match=f"{data}:2: the record is longer .* \\(1000 bytes"):
            read_jsonl(str(data), max_bytes=1000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20


def test_chat_data_with_no_assistant_turn_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": CHAT[:1]}) + "\n" for _ in range(3)))
    line = refused(capsys, *SFT, "--data.path", str(data))
    assert f"data.path {data}: {data}: nothing to train on: none of the 3 records checked" in line


# During the run: a bad record past the pre-flight's sample.


def test_a_bad_record_met_during_the_run_is_one_data_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "docs.jsonl"
    data.write_text('{"text": "a"}\n' * 100 + "{not json\n")  # the pre-flight reads 100
    args = ["--data.path", str(data), "--training.steps", "20", "--training.seq_len", "16"]
    args += ["--metrics.no-tensorboard", "--job.dump_folder", str(tmp_path / "run")]
    assert run(capsys, "--check_only", *args)[0] == 0
    code, lines = run(capsys, *args)
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith(f"temper: data error: {data}:101: invalid JSON")
