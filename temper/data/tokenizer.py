"""One tokenizer type for the built-in asset and Hugging Face ``tokenizer.json`` files."""

import json
from importlib import resources
from pathlib import Path
from typing import Any

import tokenizers

from temper.utils.paths import inside

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The special tokens of tokenizer_config.json that transformers hands a chat template."""


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the ids that packing and padding need.

    ``encode`` adds no special tokens; the data pipeline places EOS itself. Text that spells
    an added token (e.g. ``<|endoftext|>``) still encodes to that token's single id, which
    chat templates rely on.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        eos_token: str = EOS_TOKEN,
        pad_token: str | None = None,
        special_tokens: dict[str, Any] | None = None,
    ) -> None:
        # A tokenizer.json may carry truncation or padding settings meant for inference;
        # packing needs every document whole.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer
        self.eos_id = self._require_id(eos_token)
        self.pad_id = None if pad_token is None else self._require_id(pad_token)
        self.special_tokens: dict[str, Any] = {"eos_token": eos_token, "pad_token": pad_token}
        self.special_tokens |= special_tokens or {}
        """The variables a chat template sees, as transformers passes them: ``bos_token``,
        ``eos_token``, ... (from tokenizer_config.json) and ``additional_special_tokens``."""

    def _require_id(self, token: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"token {token!r} is not in the tokenizer's vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added (special) tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        """The id of ``token`` (an added token's, say), None when the vocabulary lacks it."""
        return self._tokenizer.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each token's character span [start, end) in ``text``."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` of each text, tokenized in parallel by the Rust library's threads."""
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]


def _read_tokenizer(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # the Rust side raises a bare Exception
        raise ValueError(f"{path}: not a valid tokenizer.json ({error})") from None


def _config_token(config: dict, key: str, config_path: Path) -> str | None:
    """A token from tokenizer_config.json, written either as a string or {"content": ...}."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{config_path}: {key} must be a string or {{'content': ...}}")
    return value


def _default_token(raw: tokenizers.Tokenizer, token: str) -> str | None:
    return token if raw.token_to_id(token) is not None else None


def builtin_tokenizer_path() -> Path:
    """The built-in tokenizer's file: ``data.tokenizer_path`` to it trains a model folder
    that ships no tokenizer with the built-in one."""
    return Path(str(resources.files("temper.assets").joinpath("tokenizer.json")))


def load_tokenizer(path: str | None) -> Tokenizer:
    """Load the built-in tokenizer (None), a ``tokenizer.json`` file, or an HF folder.

    In a folder, EOS and pad come from ``tokenizer_config.json`` when it names them;
    otherwise EOS is ``<|endoftext|>`` and pad is ``<|pad|>`` when in the vocabulary. A
    folder's files must lie inside it (UnsafePath for a symlink leading out).
    """
    if path is None:
        asset = builtin_tokenizer_path().read_text()
        return Tokenizer(tokenizers.Tokenizer.from_str(asset), EOS_TOKEN, PAD_TOKEN)

    target = Path(path)
    folder = target.is_dir()
    tokenizer_path = inside(target, "tokenizer.json") if folder else target
    raw = _read_tokenizer(tokenizer_path)
    eos = _default_token(raw, EOS_TOKEN)
    pad = _default_token(raw, PAD_TOKEN)
    special: dict[str, Any] = {}
    if folder and (target / "tokenizer_config.json").is_file():
        config_path = inside(target, "tokenizer_config.json")
        try:
            config = json.loads(config_path.read_text())
        except ValueError as error:
            raise ValueError(f"{config_path}: invalid JSON ({error})") from None
        if not isinstance(config, dict):
            raise ValueError(f"{config_path}: expected a JSON object")
        eos = _config_token(config, "eos_token", config_path) or eos
        pad = _config_token(config, "pad_token", config_path) or pad
        special = {key: _config_token(config, key, config_path) for key in SPECIAL_TOKEN_KEYS}
        special = {key: value for key, value in special.items() if value is not None}
        extra = config.get("additional_special_tokens") or []
        special["additional_special_tokens"] = [
            token.get("content") if isinstance(token, dict) else token for token in extra
        ]
    if eos is None:
        raise ValueError(
            f"{tokenizer_path}: no EOS token: the vocabulary has no {EOS_TOKEN!r} and no "
            "tokenizer_config.json beside it names an eos_token"
        )
    try:
        return Tokenizer(raw, eos, pad, special)
    except ValueError as error:
        raise ValueError(f"{tokenizer_path}: {error}") from None
