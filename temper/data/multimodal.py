"""Image chat data for vision-language SFT: records -> token ids, labels, pixels, positions.

A record's ``messages`` hold either a string ``content`` or a list of parts,
``{"type": "text", "text": ...}`` and ``{"type": "image", "image": "path"}`` (a local file,
relative to the JSONL file). The conversation renders with the chat template (a Qwen-VL
template writes ``IMAGE_PLACEHOLDER`` per image part) and tokenizes as text SFT does; each
placeholder then becomes the image's tokens, one per merge block of its patch grid, as
transformers' processor expands them. Images go through the model folder's own image
processor from transformers (its Pillow backend); image and prompt tokens never train.

Packing keeps each sample's images with it: a row's ``pixel_values`` and ``image_grid_thw``
are its samples' in order, and ``rope_position_ids`` (multimodal rotary) restart with each
sample, as ``position_ids`` do. A batch concatenates its rows' images (``collate``).

``ImageFormat`` is the format of such records on ``temper.data.stream.LaneStream``, as text
SFT's is: image sources mix with text ones under ``data.sources``, hold out validation
records and are read per data-parallel rank like any other.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image, UnidentifiedImageError

from temper.config import Data
from temper.data.batch import IGNORE_INDEX, MEDIA_KEYS
from temper.data.chat import (
    DEFAULT_LIMITS,
    ROLES,
    RecordError,
    TemplateLimits,
    read_jsonl,
    tokenize_chat,
)
from temper.data.mrope_positions import document_mrope_positions
from temper.data.packing import RowPacker, fill_in_order
from temper.data.sft import pad_id, sample_labels
from temper.data.sources import ListSource, Record, Source
from temper.data.stream import LaneStream
from temper.data.tokenizer import Tokenizer
from temper.data.vision_tokens import IMAGE_PLACEHOLDER, VisionTokenIds, vision_token_ids
from temper.utils.paths import inside

if TYPE_CHECKING:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

BUILTIN_VL_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '" + IMAGE_PLACEHOLDER + "' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
"""The built-in template with image parts: the built-in one, each image as the placeholder."""

ImageLoader = Callable[[], Image.Image]


@dataclass(frozen=True)
class ImageSample:
    """A tokenized conversation, its images (loaded when a row is built) and their grids."""

    ids: list[int]
    trains: list[bool]
    images: tuple[ImageLoader, ...]
    grids: torch.Tensor


def builtin_image_processor(patch_size: int = 16, merge_size: int = 2) -> Qwen2VLImageProcessorPil:
    """The processor of the debug vision-language flavors (16-pixel patches, 2 x 2 merges)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    factor = patch_size * merge_size
    return Qwen2VLImageProcessorPil(
        patch_size=patch_size,
        temporal_patch_size=2,
        merge_size=merge_size,
        size={"shortest_edge": factor * factor, "longest_edge": 64 * factor * factor},
    )


def load_image_processor(folder: str | None) -> Qwen2VLImageProcessorPil:
    """The folder's image processor (its preprocessor_config.json, which must lie inside the
    folder), else the built-in one. The processor is built from that one file's settings, so
    transformers resolves no other path of the folder."""
    if folder is None or not (Path(folder) / "preprocessor_config.json").is_file():
        if folder is not None and Path(folder).is_dir():
            raise FileNotFoundError(
                f"{folder}: no preprocessor_config.json, which image data needs"
            )
        return builtin_image_processor()
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    path = inside(folder, "preprocessor_config.json")
    try:
        settings = json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path}: invalid JSON ({error})") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return Qwen2VLImageProcessorPil.from_dict(settings)


def open_rgb(path: Path) -> Image.Image:
    with Image.open(path) as image:
        return image.convert("RGB")


def check_image(path: Path, where: str) -> ImageLoader:
    """A loader of the image at ``path``, after checking that Pillow reads it."""
    try:
        with Image.open(path) as image:
            image.verify()
    except FileNotFoundError:
        raise RecordError(f"{where}: image {path} does not exist") from None
    except (UnidentifiedImageError, OSError, SyntaxError) as error:
        raise RecordError(f"{where}: image {path} is not readable ({error})") from None
    return functools.partial(open_rgb, path)


def check_image_messages(
    value: Any, where: str, folder: Path
) -> tuple[list[dict[str, Any]], list[ImageLoader]]:
    """``value`` as messages whose content is a string or a list of text and image parts, and
    a loader per image in order (paths relative to ``folder``; the built-in task's parts hold
    the picture itself); RecordError at ``where``."""
    if not isinstance(value, list) or not value:
        raise RecordError(f"{where}: 'messages' must be a non-empty list of messages")
    messages, images = [], []
    for j, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise RecordError(f"{where}: messages[{j}] needs a role among {ROLES}")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for k, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif kind == "image" and isinstance(part.get("image"), str):
                    images.append(check_image(folder / part["image"], where))
                    parts.append({"type": "image"})
                elif kind == "image" and isinstance(part.get("image"), Image.Image):
                    images.append(functools.partial(part["image"].convert, "RGB"))
                    parts.append({"type": "image"})
                else:
                    raise RecordError(
                        f"{where}: messages[{j}].content[{k}] must be a text part "
                        '{"type": "text", "text": ...} or an image part {"type": "image", '
                        '"image": "path"}'
                    )
            content = parts
        elif not isinstance(content, str):
            raise RecordError(f"{where}: messages[{j}].content must be a string or a list")
        messages.append({"role": message["role"], "content": content})
    return messages, images


def has_image_parts(path: str, limit: int = 64, max_bytes: int = Data.max_record_bytes) -> bool:
    """Whether the first records of a chat JSONL file hold list contents (image data)."""
    for _, record in read_jsonl(path, limit, max_bytes):
        for message in record.get("messages") or []:
            if isinstance(message, dict) and isinstance(message.get("content"), list):
                return True
    return False


def read_image_records(
    path: str, limit: int | None = None, max_bytes: int = Data.max_record_bytes
) -> list[tuple[str, list[dict[str, Any]], list[ImageLoader]]]:
    """(file:line, messages, image loaders) of every record; each image is checked now."""
    folder = Path(path).parent
    return [
        (where, *check_image_messages(record.get("messages"), where, folder))
        for where, record in read_jsonl(path, limit, max_bytes)
    ]


class ImageFiles:
    """``source`` with its image parts' relative paths taken from ``folder`` (the data file's
    own), so ``ImageFormat`` reads the same records wherever the run starts."""

    def __init__(self, source: Source, folder: Path) -> None:
        self.source = source
        self.folder = folder
        self.name = source.name
        self.num_records = source.num_records
        self.fields = source.fields

    def record(self, index: int) -> Record:
        record = self.source.record(index)
        messages = record.get("messages")
        if not isinstance(messages, list):
            return record  # the format names what is wrong
        return {**record, "messages": [self._resolve(m) for m in messages]}

    def _resolve(self, message: Any) -> Any:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            return message
        parts = [
            {**part, "image": str(self.folder / part["image"])}
            if isinstance(part, dict) and isinstance(part.get("image"), str)
            else part
            for part in content
        ]
        return {**message, "content": parts}

    def where(self, index: int) -> str:
        return self.source.where(index)


class _ExpandingEncoder:
    """A tokenizer whose ``encode`` writes each image placeholder as its image's tokens,
    images taken in order across calls: how ``tokenize_chat`` sees images."""

    def __init__(self, tokenizer: Tokenizer, tokens: VisionTokenIds, sizes: list[int]) -> None:
        self.tokenizer = tokenizer
        self.special_tokens = tokenizer.special_tokens
        self.tokens = tokens
        self.sizes = sizes
        self.used = 0

    def encode(self, text: str) -> list[int]:
        pieces = text.split(IMAGE_PLACEHOLDER)
        ids = self.tokenizer.encode(pieces[0]) if pieces[0] else []
        for piece in pieces[1:]:
            n = self.sizes[self.used] if self.used < len(self.sizes) else 0
            self.used += 1
            ids += [self.tokens.start, *[self.tokens.image] * n, self.tokens.end]
            ids += self.tokenizer.encode(piece) if piece else []
        return ids


def tokenize_image_chat(
    tokenizer: Tokenizer,
    template: str,
    messages: Sequence[dict[str, Any]],
    grids: torch.Tensor,
    merge_size: int,
    where: str,
    train_on_prompt: bool = False,
    limits: TemplateLimits = DEFAULT_LIMITS,
) -> tuple[list[int], list[bool]]:
    """Token ids and per-token training flags, the image placeholders expanded to
    ``grids``' token counts; image tokens never train."""
    tokens = vision_token_ids(tokenizer)
    sizes = (grids.prod(-1) // merge_size**2).tolist()
    encoder = _ExpandingEncoder(tokenizer, tokens, sizes)
    ids, trains = tokenize_chat(encoder, template, messages, train_on_prompt, limits)  # type: ignore[arg-type]
    if encoder.used != len(sizes):
        raise RecordError(
            f"{where}: {len(sizes)} image parts but the chat template wrote {encoder.used} "
            "image placeholders"
        )
    vision = {tokens.start, tokens.image, tokens.end}
    return ids, [t and i not in vision for i, t in zip(ids, trains, strict=True)]


def process_images(
    processor: Qwen2VLImageProcessorPil, images: Sequence[Image.Image]
) -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values [patches, patch_dim] and image_grid_thw [n, 3] of ``images``."""
    if not images:
        return torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.long)
    out = processor(list(images), return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def image_samples(
    records: Sequence[tuple[str, list[dict[str, Any]], Sequence[ImageLoader]]],
    tokenizer: Tokenizer,
    template: str,
    processor: Qwen2VLImageProcessorPil,
    train_on_prompt: bool = False,
    limits: TemplateLimits = DEFAULT_LIMITS,
) -> list[ImageSample]:
    """Each record tokenized with its images' token counts (the processor sizes the grids)."""
    samples = []
    for where, messages, images in records:
        _, grids = process_images(processor, [load() for load in images])
        ids, trains = tokenize_image_chat(
            tokenizer,
            template,
            messages,
            grids,
            processor.merge_size,
            where,
            train_on_prompt,
            limits,
        )
        samples.append(ImageSample(ids, trains, tuple(images), grids))
    return samples


def image_row(
    samples: Sequence[ImageSample],
    seq_len: int,
    fill: int,
    pack: bool,
    processor: Qwen2VLImageProcessorPil,
    image_token_id: int,
) -> dict[str, torch.Tensor]:
    """The row of ``samples`` (whole, in order), as ``temper.data.sft.sft_row``, with each
    sample's pixels, grids and multimodal positions (restarting per sample)."""
    input_ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    rope: list[torch.Tensor] = []
    images: list[Image.Image] = []
    for sample in samples:
        inputs, targets = sample_labels(sample.ids, sample.trains)
        rope.append(
            document_mrope_positions(
                torch.tensor(inputs), sample.grids, image_token_id, processor.merge_size
            )
        )
        input_ids += inputs
        labels += targets
        positions += range(len(inputs))
        images += [load() for load in sample.images]
    pad = seq_len - len(input_ids)
    pixel_values, grids = process_images(processor, images)
    row = {
        "input_ids": torch.tensor(input_ids + [fill] * pad),
        "labels": torch.tensor(labels + [IGNORE_INDEX] * pad),
        "pixel_values": pixel_values,
        "image_grid_thw": grids,
        "rope_position_ids": torch.cat([*rope, torch.arange(pad).expand(3, -1)], dim=1),
    }
    if pack:
        row["position_ids"] = torch.tensor(positions + list(range(pad)))
    return row


def image_width(sample: ImageSample) -> int:
    """Positions a sample takes in a row: its inputs, all tokens but the last."""
    return len(sample.ids) - 1


class ImageFormat:
    """Chat records whose contents may hold image parts to samples with their images (see the
    module docstring). Records without images are plain chat samples in the same rows, so an
    image source mixes with a text one. Packing takes whole samples in reading order and
    holds nothing between rows (``fill_in_order``): image samples are not saved with the
    data state. A sample longer than ``seq_len + 1`` tokens is dropped whatever
    ``data.max_length_policy`` says: cutting it could split an image's tokens."""

    required = (("messages",),)
    shuffle = True

    def __init__(
        self,
        tokenizer: Tokenizer,
        template: str,
        processor: Qwen2VLImageProcessorPil,
        seq_len: int,
        *,
        train_on_prompt: bool = False,
        pack: bool = True,
        limits: TemplateLimits = DEFAULT_LIMITS,
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.processor = processor
        self.seq_len = seq_len
        self.train_on_prompt = train_on_prompt
        self.pack = pack
        self.limits = limits

    def sample(self, record: Record, where: str) -> ImageSample:
        """The record tokenized, its image parts (paths or in-memory pictures) checked."""
        messages, images = check_image_messages(record.get("messages"), where, Path())
        return image_samples(
            [(where, messages, images)],
            self.tokenizer,
            self.template,
            self.processor,
            self.train_on_prompt,
            self.limits,
        )[0]

    def fit(self, sample: ImageSample) -> tuple[ImageSample | None, str | None]:
        """The sample, or None ("dropped") when over-long or with nothing to train on."""
        if len(sample.ids) <= self.seq_len + 1 and any(sample.trains[1:]):
            return sample, None
        return None, "dropped"

    def encode(self, record: Record, where: str) -> tuple[ImageSample | None, str | None]:
        return self.fit(self.sample(record, where))

    def tokens(self, sample: ImageSample) -> int:
        return len(sample.ids)

    def packer(self) -> RowPacker:
        build = functools.partial(
            image_row,
            seq_len=self.seq_len,
            fill=pad_id(self.tokenizer),
            pack=self.pack,
            processor=self.processor,
            image_token_id=vision_token_ids(self.tokenizer).image,
        )
        room = self.seq_len if self.pack else 0
        return RowPacker(lambda reader: build(fill_in_order(reader, image_width, room)))


class _EncodedImages(ImageFormat):
    """Records that hold an already tokenized ``ImageSample`` under ``"sample"``."""

    required = (("sample",),)

    def encode(self, record: Record, where: str) -> tuple[ImageSample | None, str | None]:
        return self.fit(record["sample"])


def image_sft_dataset(
    samples: Sequence[ImageSample],
    tokenizer: Tokenizer,
    processor: Qwen2VLImageProcessorPil,
    seq_len: int,
    *,
    pack: bool = True,
    seed: int = 0,
    lanes: int = 1,
    dp_rank: int = 0,
    dp_world: int = 1,
) -> LaneStream:
    """The row stream of tokenized image SFT samples (see ``ImageFormat``; ``LaneStream``
    for ``lanes``)."""
    fmt = _EncodedImages(tokenizer, "", processor, seq_len, pack=pack)
    source = ListSource([{"sample": s} for s in samples], "image samples")
    return LaneStream([source], fmt, lanes=lanes, dp_rank=dp_rank, dp_world=dp_world, seed=seed)


def collate(rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A batch of rows: token tensors stacked [b, s], multimodal positions [3, b, s], the
    rows' images concatenated in row order (left out when no row has one)."""
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0] if k not in MEDIA_KEYS}
    if "rope_position_ids" in rows[0]:
        batch["rope_position_ids"] = torch.stack([r["rope_position_ids"] for r in rows], dim=1)
    grids = [r["image_grid_thw"] for r in rows if "image_grid_thw" in r]
    if any(len(g) for g in grids):
        batch["image_grid_thw"] = torch.cat(grids)
        batch["pixel_values"] = torch.cat(
            [r["pixel_values"] for r in rows if len(r["image_grid_thw"])]
        )
    return batch
