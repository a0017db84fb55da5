"""Keys and values kept between decoding steps, so each step runs the model on new tokens only.

Rows are decoded in lockstep: every forward appends the same number of tokens to each row, so
one column index serves the whole batch. Prompts of different lengths are left-padded; a
``valid`` mask over the columns hides the padding. Each layer stores the keys and values its
attention hands it, head-major: rotary GQA ``[b, n_kv_heads, max_len, head_dim]``, MLA its
per-head expanded keys and values (what transformers caches too), which costs more memory than
the latent but reads the same way as GQA; both attend with ``cached_attention``.
``StaticKVCache`` is the variant with fixed shapes that a compiled decode step needs.
"""

from __future__ import annotations

import torch

from temper.kernels.attention import causal_band
from temper.utils.compat import dynamic_size


class KVCache:
    """Every layer's keys and values for a batch of rows decoded together.

    ``valid`` [b, max_len] is True where a column holds a real token (False: left padding);
    ``length`` columns are filled. ``bias`` [b, 1, n, length] fp32 is the running forward's
    attention mask as a logit bias, 0 where a query sees a key and -inf where not: a query at
    column i attends to the valid columns up to i, and a padding query to itself only, so no
    softmax row is empty (an empty row gives NaN, which would reach real tokens through the
    cached values even with a weight of 0). Added to the logits rather than applied with
    ``masked_fill``, whose boolean mask the compiler's CPU kernels read back slowly (the masked
    softmax took 3x as long as with the bias in a compiled decode step).

    Plain classes, not dataclasses: FSDP2 rebuilds dataclass arguments when it casts a
    module's inputs, and the copy would drop what a layer writes.
    """

    def __init__(self, valid: torch.Tensor, n_layers: int) -> None:
        self.valid = valid
        self.length = 0
        self.bias: torch.Tensor | None = None
        self.layers = [LayerCache(self) for _ in range(n_layers)]
        self._plan_step_bias()

    def _plan_step_bias(self) -> None:
        """A query at a column where every row holds a token (a decode step's, as
        ``generate`` lays the columns out) sees exactly the valid columns up to it: its bias
        is then a slice of ``valid_bias``, built once, instead of ten small ops per token.
        Which columns qualify is read back once, here, not per step."""
        self.valid_bias = logit_bias(self.valid[:, None, :])
        self.all_valid: list[bool] = self.valid.all(dim=0).tolist()

    def _check_room(self, end: int) -> None:
        if end > self.valid.shape[1]:
            raise ValueError(f"KV cache holds {self.valid.shape[1]} tokens per row, {end} asked")

    def _bias(self, keys: torch.Tensor, start: int) -> torch.Tensor:
        """The bias [b, 1, n, end] of the queries at columns ``start`` to ``end`` over the
        keys ``keys`` (the ids 0 to end - 1)."""
        end = keys.shape[0]
        if end - start == 1 and self.all_valid[start]:
            return self.valid_bias[..., :end]
        queries = keys[start:, None]
        visible = self.valid[:, None, :end] | (keys == queries)
        return logit_bias(visible & (keys <= queries))

    def open(self, n: int) -> None:
        """Nothing: a growing cache makes room in ``extend``. (``StaticKVCache`` needs it
        before each forward, which is why ``generate`` calls it for every cache.)"""

    def extend(self, n: int) -> list[LayerCache]:
        """Open ``n`` more columns for the forward about to run, build the bias its layers
        share, and return one cache per layer."""
        start, end = self.length, self.length + n
        self._check_room(end)
        self.bias = self._bias(torch.arange(end, device=self.valid.device), start)
        self.length = end
        return self.layers


class LayerCache:
    """One layer's keys and values, allocated on first use with the shape and dtype the layer
    produces (so GQA and MLA layers share the class). A linear-attention layer (Gated
    DeltaNet) keeps its convolution window and recurrent state here instead."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.conv_window: torch.Tensor | None = None
        """[b, kernel - 1, channels]: the convolution inputs of the latest columns."""
        self.state: torch.Tensor | None = None
        """[b, n_v_heads, d_k, d_v]: the delta rule's state after the latest column."""
        self.index_k: torch.Tensor | None = None
        """[b, max_len, d]: DeepSeek sparse attention's indexer keys."""
        self.kept: dict[str, torch.Tensor] = {}
        """Per-column tensors [b, max_len, ...] by name (``keep``): DeepSeek V4's reference
        keeps its attention inputs and recomputes keys and compressed entries from them."""

    def valid_columns(self, n: int) -> torch.Tensor:
        """[b, n] True where the running forward's n tokens are real (not left padding)."""
        end = self.cache.length
        return self.cache.valid[:, end - n : end]

    def visible(self) -> torch.Tensor:
        """[b, n, end] True where the running forward's queries see a filled column."""
        return self.cache.bias[:, 0] == 0

    def keep(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Store this forward's x [b, n, ...] in its columns under ``name``; every column so far
        [b, end, ...]."""
        cache = self.cache
        if name not in self.kept:
            b, max_len = cache.valid.shape
            self.kept[name] = x.new_zeros(b, max_len, *x.shape[2:])
        self.kept[name][:, cache.length - x.shape[1] : cache.length] = x
        return self.kept[name][:, : cache.length]

    def index_keys(self, k: torch.Tensor) -> torch.Tensor:
        """Store this forward's indexer keys k [b, n, d] in their columns; every one so far
        [b, end, d]."""
        cache = self.cache
        if self.index_k is None:
            self.index_k = k.new_zeros(cache.valid.shape[0], cache.valid.shape[1], k.shape[2])
        self.index_k[:, cache.length - k.shape[1] : cache.length] = k
        return self.index_k[:, : cache.length]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        chosen: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store this forward's k, v [b, n, h_kv, d] in their columns, then attend q [b, n, h, d]
        to every key so far: [b, n, h, d_v]. ``scale``, ``window`` (in columns, as
        transformers' sliding caches count) and ``sinks`` as for ``attention``; ``chosen``
        [b, n, end] (DeepSeek sparse attention's top-k) narrows each query's keys further."""
        cache = self.cache
        if self.k is None or self.v is None:
            b, max_len = cache.valid.shape
            self.k = k.new_zeros(b, k.shape[2], max_len, k.shape[3])
            self.v = v.new_zeros(b, v.shape[2], max_len, v.shape[3])
        start, end = cache.length - k.shape[1], cache.length
        self.k[:, :, start:end] = k.transpose(1, 2)
        self.v[:, :, start:end] = v.transpose(1, 2)
        bias = cache.bias
        if window is not None:
            band = causal_band(q.shape[1], end, window, q.device)
            bias = bias.masked_fill(~band, float("-inf"))
        if chosen is not None:
            bias = bias.masked_fill(~chosen[:, None], float("-inf"))
        keys, values = self.k[:, :, :end], self.v[:, :, :end]
        return cached_attention(q, keys, values, bias, scale=scale, sinks=sinks)


class StaticKVCache(KVCache):
    """A KV cache whose buffers never change shape (gpt-fast's approach), so one compiled
    decode step serves every token.

    What a forward reads and writes is given by tensors, never by a Python count (a compiled
    step would specialize on it): ``keys``, the ids of the columns filled once the forward has
    run, ``columns``, the last of them, which the forward writes, and the ``bias`` over
    ``keys``. ``open(n)`` sets them before each forward of ``n`` tokens, outside the compiled
    step, and marks the filled length as a dynamic size: the step is one graph for every
    length, and attention reads only the filled columns, as the growing cache does, not the
    whole buffer (at the rollout benchmark's debug shape the attention's products over the
    whole buffer were a third of the compiled step's profile). ``max_len`` may exceed what
    the rows need: a rounded-up length lets batches of different prompt widths share one
    compiled step.
    """

    def __init__(self, valid: torch.Tensor, n_layers: int, max_len: int | None = None) -> None:
        b, needed = valid.shape
        max_len = max_len or needed
        if max_len < needed:
            raise ValueError(f"StaticKVCache max_len {max_len} below the {needed} columns needed")
        self.valid = torch.cat([valid, valid.new_zeros(b, max_len - needed)], 1)
        self.bias: torch.Tensor | None = None
        self.layers = [StaticLayerCache(self) for _ in range(n_layers)]
        self.column_ids = torch.arange(max_len, device=valid.device)
        self.keys = self.column_ids[:0]
        self.columns = self.keys
        self._plan_step_bias()

    @property
    def length(self) -> int:  # type: ignore[override]
        """Not kept as a number (a compiled step would specialize on it): callers pass
        ``position_ids``."""
        raise ValueError("a StaticKVCache counts its columns in a tensor: pass position_ids")

    def open(self, n: int) -> None:
        """Make room for a forward of ``n`` tokens and build its bias; call it before each
        forward, outside a compiled step (it reads the filled length as a Python number).
        ``keys`` and ``bias`` have the filled length marked dynamic: a compiled step that
        FSDP2's hooks split into several graphs gets it as an input of each graph, from
        tensors built here, so none of them specializes on it. A decode step's bias is a
        slice (``_plan_step_bias``): 4% of the compiled path at dim 64 when it was built per
        token."""
        end = self.keys.shape[0] + n
        self._check_room(end)
        keys = self.column_ids[:end]
        self.columns = keys[end - n :]
        self.bias = dynamic_size(self._bias(keys, end - n), 3)
        self.keys = dynamic_size(keys, 0)

    def extend(self, n: int) -> list[LayerCache]:
        """The layers, which read what ``open`` set (no Python value changes between
        steps)."""
        return self.layers


class StaticLayerCache(LayerCache):
    """``LayerCache`` for ``StaticKVCache``: writes at the cache's ``columns`` and attends to
    its filled columns, ``keys``."""

    cache: StaticKVCache

    @property
    def conv_window(self) -> torch.Tensor | None:
        return self._conv_window

    @conv_window.setter
    def conv_window(self, window: torch.Tensor | None) -> None:
        # Stored contiguous: the window is a slice of each forward's inputs, whose strides
        # differ between the prefill and a step, and a compiled step guards on strides (it
        # compiled twice for Gated DeltaNet layers without this).
        self._conv_window = None if window is None else window.contiguous()

    def valid_columns(self, n: int) -> torch.Tensor:
        return self.cache.valid.index_select(1, self.cache.columns)

    def index_keys(self, k: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        if self.index_k is None:
            self.index_k = k.new_zeros(cache.valid.shape[0], cache.valid.shape[1], k.shape[2])
        self.index_k[:, cache.columns] = k
        return self.index_k[:, : cache.keys.shape[0]]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        chosen: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cache = self.cache
        if self.k is None or self.v is None:
            b, max_len = cache.valid.shape
            self.k = k.new_zeros(b, k.shape[2], max_len, k.shape[3])
            self.v = v.new_zeros(b, v.shape[2], max_len, v.shape[3])
        # Indexed assignment (index_put_), which the compiler keeps in place.
        self.k[:, :, cache.columns] = k.transpose(1, 2)
        self.v[:, :, cache.columns] = v.transpose(1, 2)
        bias, keys = cache.bias, cache.keys
        if window is not None:  # the band by column, as attention's causal_band draws it
            bias = torch.where(cache.columns[:, None] - keys < window, bias, float("-inf"))
        if chosen is not None:
            bias = bias.masked_fill(~chosen[:, None], float("-inf"))
        filled = keys.shape[0]
        k_seen, v_seen = self.k[:, :, :filled], self.v[:, :, :filled]
        return cached_attention(q, k_seen, v_seen, bias, scale=scale, sinks=sinks)


def logit_bias(visible: torch.Tensor) -> torch.Tensor:
    """[b, 1, n, s] fp32 attention bias from the [b, n, s] mask of the keys each query sees:
    0 where it sees one, -inf where not."""
    return torch.where(visible, 0.0, float("-inf")).unsqueeze(1)


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v written out for a few queries q [b, n, h, d] over a head-major
    cache k [b, h_kv, s, d], v [b, h_kv, s, d_v] with the logit ``bias`` [b, 1, n, s] fp32
    (0 or -inf: ``KVCache``): [b, n, h, d_v].

    The definition ``attention`` computes, in two batched products on the cache as it lies.
    CPU's sdpa kernel is tiled for long query blocks: for a decode step's single query over a
    static buffer it was the largest item of the compiled step's profile, 3 ms of a 9 ms step
    at dim 64 (and a third of the eager step's). The query heads that share a key head
    become the rows of one product; ``sinks`` [h] add a logit per head to each row's softmax,
    then drop out.
    """
    b, n, h, d = q.shape
    h_kv, s = k.shape[1], k.shape[2]
    groups = h // h_kv
    scale = d**-0.5 if scale is None else scale
    # [b, n, h_kv * groups, d] -> [b, h_kv, groups * n, d]: query head i reads key head i // groups.
    rows = q.view(b, n, h_kv, groups, d).permute(0, 2, 3, 1, 4).reshape(b, h_kv, groups * n, d)
    scores = (rows @ k.transpose(2, 3)).float() * scale
    scores = scores.view(b, h_kv, groups, n, s) + bias[:, :, None]
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        sink = sinks.float().view(1, h_kv, groups, 1, 1).expand(b, h_kv, groups, n, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    out = probs.to(v.dtype).reshape(b, h_kv, groups * n, s) @ v
    return out.view(b, h_kv, groups, n, -1).permute(0, 3, 1, 2, 4).reshape(b, n, h, -1)
