"""Image chat data against transformers' own processor and chat template.

A Qwen-VL processor (`Qwen3VLProcessor` with the Pillow image processor and a tokenizer that
has the vision tokens) renders and tokenizes the same messages: Temper's rows hold its
token ids, pixel values and grids, exactly; the labels train the assistant's tokens only;
packed samples keep their own images and restart their positions. Missing or unreadable
images and image parts the template drops are refused at file:line.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest
import tokenizers
import torch
from PIL import Image, ImageDraw
from transformers import PreTrainedTokenizerFast, Qwen3VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from temper.data.batch import IGNORE_INDEX
from temper.data.chat import RecordError, load_chat_template
from temper.data.multimodal import (
    collate,
    image_samples,
    image_sft_dataset,
    load_image_processor,
    read_image_records,
)
from temper.data.tokenizer import load_tokenizer

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VISION = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]


def processor_folder(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Qwen3VLProcessor:
    """A model folder's processor files, and transformers' processor made of them (no
    torchvision here, so no video processor: its class check is skipped)."""
    asset = resources.files("temper.assets").joinpath("tokenizer.json").read_text()
    raw = tokenizers.Tokenizer.from_str(asset)
    raw.add_special_tokens(VISION)
    folder.mkdir()
    raw.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|pad|>", "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    images = Qwen2VLImageProcessorPil(
        patch_size=4,
        temporal_patch_size=2,
        merge_size=2,
        size={"shortest_edge": 64, "longest_edge": 1024},
    )
    images.save_pretrained(folder)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|pad|>"
    )
    monkeypatch.setattr(Qwen3VLProcessor, "check_argument_for_proper_class", lambda *_: None)
    return Qwen3VLProcessor(images, tokenizer, None, chat_template=TEMPLATE)


def draw(path: Path, size: tuple[int, int], colour: tuple[int, int, int]) -> Image.Image:
    image = Image.new("RGB", size, (20, 30, 40))
    ImageDraw.Draw(image).rectangle((3, 2, size[0] - 4, size[1] - 5), fill=colour)
    image.save(path)
    return image


def records(folder: Path) -> list[list[dict]]:
    """Two conversations: two images in one user turn; one image after text."""
    (folder / "img").mkdir()
    draw(folder / "img" / "a.png", (16, 24), (255, 0, 0))
    draw(folder / "img" / "b.png", (32, 16), (0, 255, 0))
    draw(folder / "img" / "c.png", (20, 20), (0, 0, 255))
    return [
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": "img/a.png"},
                    {"type": "image", "image": "img/b.png"},
                    {"type": "text", "text": "copy: a b"},
                ],
            },
            {"role": "assistant", "content": "a b"},
        ],
        [
            {"role": "system", "content": "sort: 3 1"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "x"}, {"type": "image", "image": "img/c.png"}],
            },
            {"role": "assistant", "content": "1 3"},
        ],
    ]


def write_jsonl(path: Path, conversations: list[list[dict]]) -> None:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))


def with_pil(conversation: list[dict], folder: Path) -> list[dict]:
    """The messages as transformers takes them: image parts holding the opened image."""
    out = []
    for m in conversation:
        content = m["content"]
        if isinstance(content, list):
            content = [
                {"type": "image", "image": Image.open(folder / p["image"]).convert("RGB")}
                if p["type"] == "image"
                else p
                for p in content
            ]
        out.append({"role": m["role"], "content": content})
    return out


def test_rows_equal_the_processor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model"
    processor = processor_folder(model, monkeypatch)
    conversations = records(tmp_path)
    write_jsonl(tmp_path / "chat.jsonl", conversations)

    tokenizer = load_tokenizer(str(model))
    template = load_chat_template(None, str(model))
    images = load_image_processor(str(model))
    samples = image_samples(
        read_image_records(str(tmp_path / "chat.jsonl")), tokenizer, template, images
    )
    expected = []
    for conversation in conversations:
        messages = with_pil(conversation, tmp_path)
        want = processor.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_tensors="pt"
        )
        prompt = processor.apply_chat_template(
            messages[:-1],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
        )
        expected.append((want, prompt["input_ids"].shape[1]))

    # One row per sample (unpacked), in the stream's order; and both packed in one row.
    stream = image_sft_dataset(samples, tokenizer, images, seq_len=200, pack=False, seed=0)
    rows = [next(iter(stream)) for _ in range(2)]
    order = [0 if len(r["image_grid_thw"]) == 2 else 1 for r in rows]
    assert sorted(order) == [0, 1]
    for row, k in zip(rows, order, strict=True):
        want, n_prompt = expected[k]
        ids = want["input_ids"][0]
        n = len(ids) - 1
        assert torch.equal(row["input_ids"][:n], ids[:-1])
        assert torch.equal(row["pixel_values"], want["pixel_values"])
        assert torch.equal(row["image_grid_thw"], want["image_grid_thw"])
        labels = row["labels"][:n]
        assert (labels[: n_prompt - 1] == IGNORE_INDEX).all()  # prompt and image tokens
        assert torch.equal(labels[n_prompt - 1 :], ids[n_prompt:])  # the answer and its end
        assert (row["labels"][n:] == IGNORE_INDEX).all()

    packed = image_sft_dataset(samples, tokenizer, images, seq_len=200, pack=True, seed=0)
    row = next(iter(packed))
    lengths = [len(expected[k][0]["input_ids"][0]) - 1 for k in order]
    assert torch.equal(
        row["position_ids"][: sum(lengths)], torch.cat([torch.arange(n) for n in lengths])
    )
    want_grids = torch.cat([expected[k][0]["image_grid_thw"] for k in order])
    assert torch.equal(row["image_grid_thw"], want_grids)
    assert torch.equal(
        row["pixel_values"], torch.cat([expected[k][0]["pixel_values"] for k in order])
    )
    second = row["rope_position_ids"][:, lengths[0]]
    assert second.tolist() == [0, 0, 0]  # the second sample's positions restart

    batch = collate([row, row])
    assert batch["rope_position_ids"].shape == (3, 2, 200)
    assert batch["image_grid_thw"].shape[0] == 2 * len(want_grids)


def test_bad_images_are_refused_at_file_and_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "model"
    processor_folder(model, monkeypatch)
    conversations = records(tmp_path)
    (tmp_path / "img" / "bad.png").write_bytes(b"not an image")
    missing = json.loads(json.dumps(conversations[1]))
    missing[1]["content"][1]["image"] = "img/none.png"
    unreadable = json.loads(json.dumps(conversations[1]))
    unreadable[1]["content"][1]["image"] = "img/bad.png"
    for conversation, problem in ((missing, "does not exist"), (unreadable, "is not readable")):
        write_jsonl(tmp_path / "chat.jsonl", [conversations[0], conversation])
        with pytest.raises(RecordError, match=rf"chat.jsonl:2: image .* {problem}"):
            read_image_records(str(tmp_path / "chat.jsonl"))

    # A template that writes no image placeholder: more image parts than placeholders.
    write_jsonl(tmp_path / "chat.jsonl", conversations)
    text_only = TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "")
    with pytest.raises(RecordError, match=r"chat.jsonl:1: 2 image parts but .* wrote 0"):
        image_samples(
            read_image_records(str(tmp_path / "chat.jsonl")),
            load_tokenizer(str(model)),
            text_only,
            load_image_processor(str(model)),
        )
