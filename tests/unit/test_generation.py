"""Generation against references: decoding each prompt alone without a cache, the trainer's
forward for log-probabilities, transformers' generate, and sampling distributions by hand."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from temper.data.batch import IGNORE_INDEX
from temper.generation import KVCache, decoding, generate, sample_next
from temper.generation.sampling import greedy_pick, sample_with_log_prob
from temper.kernels.attention import AttentionBackendError, attention
from temper.kernels.cross_entropy import linear_log_probs
from temper.models import get_model_spec, load_hf, materialize
from temper.objectives.causal_lm import documents

VOCAB = 128
SMALL = {"dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": VOCAB, "ffn_hidden_dim": 96}
TINY = {  # each family's debug flavor, shrunk; every MoE family keeps one dense and one MoE block
    "llama3": {**SMALL, "n_kv_heads": 2, "head_dim": 16},
    "qwen3": {**SMALL, "n_kv_heads": 2, "head_dim": 16},
    "qwen3_moe": {**SMALL, "n_kv_heads": 2, "head_dim": 16, "moe_hidden_dim": 32},
    "deepseek_v3": {
        **SMALL,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 12,
        "qk_rope_head_dim": 8,
        "v_head_dim": 10,
        "moe_hidden_dim": 32,
    },
    # Window 4: the prompts and their continuations run past it; sinks in every layer.
    "gpt_oss": {
        **{k: v for k, v in SMALL.items() if k != "ffn_hidden_dim"},
        "n_kv_heads": 2,
        "head_dim": 16,
        "moe_hidden_dim": 32,
        "sliding_window": 4,
        "layer_types": (),
    },
}
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 1, 2]]
NEW = 6


def tiny_model(family: str) -> nn.Module:
    spec = get_model_spec(family)
    args = dataclasses.replace(spec.flavors["debug"], **TINY[family])
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.model_cls(args)
    return materialize(model, "cpu")


def greedy_alone(model: nn.Module, prompt: list[int], n: int) -> list[int]:
    """The reference: one prompt, no padding, no cache, the whole sequence every step."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


def trainer_log_probs(
    model: nn.Module,
    prompts: list[list[int]],
    completions: list[list[int]],
    temperature: float = 1.0,
):
    """Each completion token's log-probability as the trainer computes it: all sequences
    packed in one row (positions restart per document), hidden states, then the LM head's
    log-softmax, at ``temperature``, on completion labels only."""
    ids, positions, labels = [], [], []
    for prompt, completion in zip(prompts, completions, strict=True):
        seq = prompt + completion
        ids += seq
        positions += range(len(seq))
        labels += [IGNORE_INDEX] * (len(prompt) - 1) + completion + [IGNORE_INDEX]
    batch = {"input_ids": torch.tensor([ids]), "position_ids": torch.tensor([positions])}
    with torch.no_grad():
        hidden = model.hidden_states(batch["input_ids"], batch["position_ids"], documents(batch))
        log_probs, _ = linear_log_probs(
            hidden / temperature, model.output.weight, torch.tensor([labels])
        )
    return log_probs[0][torch.tensor(labels) != IGNORE_INDEX]


@pytest.mark.parametrize("family", list(TINY))
def test_cached_batched_greedy_equals_each_prompt_decoded_alone(family: str) -> None:
    model = tiny_model(family)
    out = generate(model, PROMPTS, NEW)
    assert out.tokens.tolist() == [greedy_alone(model, p, NEW) for p in PROMPTS]
    assert out.lengths.tolist() == [NEW] * len(PROMPTS)
    assert out.log_probs is None


@pytest.mark.parametrize("family", list(TINY))
def test_sampled_log_probs_equal_the_trainer_forward(family: str) -> None:
    """Sampled with temperature, top-k and top-p; the log-probabilities are those of the
    tempered, unfiltered distribution: what the trainer computes for the same tokens."""
    model = tiny_model(family)
    gen = torch.Generator().manual_seed(1)
    out = generate(
        model, PROMPTS, NEW, 0.9, top_k=40, top_p=0.9, generator=gen, return_log_probs=True
    )
    expected = trainer_log_probs(model, PROMPTS, out.tokens.tolist(), temperature=0.9)
    torch.testing.assert_close(out.log_probs.flatten(), expected, rtol=0, atol=1e-5)


def test_stop_tokens_end_rows_and_pad_after() -> None:
    """The run without stop tokens, cut after each row's first stop token; pad_id -1 shows that
    padding is never fed to the model."""
    model = tiny_model("llama3")
    full = generate(model, PROMPTS, NEW, return_log_probs=True)
    stop = full.tokens[0, 2].item()
    out = generate(model, PROMPTS, NEW, stop_tokens={stop}, pad_id=-1, return_log_probs=True)
    assert out.lengths[0] <= 3
    for i, row in enumerate(full.tokens.tolist()):
        n = row.index(stop) + 1 if stop in row else NEW
        assert out.lengths[i] == n
        assert out.tokens[i].tolist() == row[:n] + [-1] * (NEW - n)
        torch.testing.assert_close(out.log_probs[i, :n], full.log_probs[i, :n], rtol=0, atol=1e-6)
        assert out.log_probs[i, n:].tolist() == [0.0] * (NEW - n)


def test_a_batch_whose_rows_all_stopped_ends_early_with_the_same_tokens() -> None:
    """Stop tokens that every row meets within 4 tokens of 20: the run without them cut after
    each row's first one, from the prefill and STOP_CHECK_EVERY - 1 decode steps, the first
    check after every row stopped (20 forwards without the stops)."""
    model = tiny_model("llama3")
    new = 20
    full = generate(model, PROMPTS, new, return_log_probs=True)
    stops = {row[3] for row in full.tokens.tolist()}
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    out = generate(model, PROMPTS, new, stop_tokens=stops, pad_id=-1, return_log_probs=True)
    assert len(forwards) == decoding.STOP_CHECK_EVERY
    for i, row in enumerate(full.tokens.tolist()):
        n = next(j for j, t in enumerate(row) if t in stops) + 1
        assert n <= 4 and out.lengths[i] == n
        assert out.tokens[i].tolist() == row[:n] + [-1] * (new - n)
        torch.testing.assert_close(out.log_probs[i, :n], full.log_probs[i, :n], rtol=0, atol=1e-6)
        assert out.log_probs[i, n:].tolist() == [0.0] * (new - n)


def test_top_k_1_samples_the_greedy_tokens_and_a_seed_repeats_a_sample() -> None:
    model = tiny_model("qwen3")
    greedy = generate(model, PROMPTS, NEW).tokens
    assert torch.equal(generate(model, PROMPTS, NEW, 1.5, top_k=1).tokens, greedy)
    samples = [
        generate(model, PROMPTS, NEW, 1.0, generator=torch.Generator().manual_seed(7)).tokens
        for _ in range(2)
    ]
    assert torch.equal(*samples)


def test_the_compiled_greedy_pick_is_argmax_ties_included() -> None:
    """Traced (is_compiling), greedy_pick takes its two-reduction form: the first maximum of
    each row, as argmax, for ties in the middle, a row all equal and a maximum at the end."""
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    logits[1, [3, 17, 40]] = 9.0
    logits[2] = 0.5
    logits[3, 49] = 100.0
    logits[4, [0, 49]] = 7.0
    traced = torch.compile(greedy_pick, backend="eager", fullgraph=True)
    assert (
        traced(logits).tolist()
        == logits.argmax(dim=-1).tolist()
        == [
            int(logits[0].argmax()),
            3,
            0,
            49,
            0,
        ]
    )


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, None, 1.0), (0.7, None, 1.0), (1.0, 5, 0.9), (0.0, None, 1.0)],
)
def test_sample_with_log_prob_draws_the_reference_tokens_and_log_softmax(
    temperature: float, top_k: int | None, top_p: float
) -> None:
    """The one-pass draw (log-prob read from the sampled probabilities, no division at
    temperature 1) against the definition on the same generator state: inverse CDF over the
    filtered softmax(logits / temperature), log_softmax of the unfiltered scaled logits (greedy:
    argmax, temperature 1); and generate's tokens with and without log-probs agree."""
    torch.manual_seed(0)
    logits = torch.randn(32, 200) * 3
    token, log_prob = sample_with_log_prob(
        logits, temperature, top_k, top_p, torch.Generator().manual_seed(3)
    )
    scaled = logits / (temperature or 1.0)
    if temperature == 0:
        expected = logits.argmax(dim=-1)
    else:
        kept = scaled.masked_fill(scaled < scaled.topk(top_k or 200).values[:, -1:], -torch.inf)
        probs = kept.softmax(dim=-1)
        # Nucleus: a token goes when the tokens more likely than it already hold top_p.
        ahead = (probs[:, None, :] * (probs[:, None, :] > probs[:, :, None])).sum(dim=-1)
        kept = kept.masked_fill(ahead >= top_p, -torch.inf)
        # Inverse CDF with one fp64 uniform per row: the tokens whose running sum stays at or
        # below u times the total come before the drawn one.
        cdf = kept.softmax(dim=-1).double().cumsum(dim=-1)
        u = torch.rand(32, 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        expected = (cdf <= u * cdf[:, -1:]).sum(dim=-1)
    assert torch.equal(token, expected)
    reference = scaled.log_softmax(dim=-1).gather(1, expected[:, None]).squeeze(1)
    torch.testing.assert_close(log_prob, reference, rtol=0, atol=2e-6)
    model = tiny_model("qwen3")
    runs = [
        generate(
            model, PROMPTS, NEW, temperature, top_k=top_k, top_p=top_p,
            generator=torch.Generator().manual_seed(5), return_log_probs=with_log_probs,
        ).tokens
        for with_log_probs in (False, True)
    ]  # fmt: skip
    assert torch.equal(*runs)


PROBS = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "expected"),
    [
        (1.0, None, 1.0, PROBS),
        (1.0, 2, 1.0, torch.tensor([0.4, 0.3, 0, 0, 0]) / 0.7),
        # 0.4 + 0.3 < 0.75: the smallest set reaching 0.75 also takes the 0.2 token.
        (1.0, None, 0.75, torch.tensor([0.4, 0.3, 0.2, 0, 0]) / 0.9),
        (1.0, None, 0.4, torch.tensor([1.0, 0, 0, 0, 0])),
        (2.0, None, 1.0, PROBS.sqrt() / PROBS.sqrt().sum()),
        (2.0, 3, 0.5, PROBS[:2].sqrt().div(PROBS[:2].sqrt().sum()).tolist() + [0, 0, 0]),
    ],
)
def test_sampling_frequencies_follow_the_filtered_distribution(
    temperature: float, top_k: int | None, top_p: float, expected
) -> None:
    """40000 draws of one row; 4 standard deviations of a frequency are under 0.01. In the
    last case temperature 2 makes the 3 kept tokens' shares 0.39, 0.34, 0.27, and top-p 0.5
    keeps the first two."""
    n = 40_000
    logits = PROBS.log().expand(n, -1)
    gen = torch.Generator().manual_seed(0)
    tokens = sample_next(logits, temperature, top_k, top_p, gen)
    freq = torch.bincount(tokens, minlength=len(PROBS)).float() / n
    torch.testing.assert_close(freq, torch.as_tensor(expected).float(), rtol=0, atol=0.01)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": 1.0, "top_k": 0}, "top_k"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"input_ids": [[1], []]}, "non-empty"),
    ],
)
def test_bad_arguments_fail_by_name(kwargs: dict, message: str) -> None:
    model = tiny_model("llama3")
    call = {"input_ids": PROMPTS, "max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate(model, **call)


def test_kv_cache_mask_by_hand() -> None:
    """Row 0 has one column of left padding: padding sees only itself, real tokens skip it."""
    valid = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    cache = KVCache(valid, n_layers=1)
    cache.extend(3)
    assert cache.bias.shape == (2, 1, 3, 3) and cache.bias.dtype == torch.float32
    assert set(cache.bias.unique().tolist()) == {0.0, float("-inf")}
    seen = cache.bias == 0
    assert seen[0, 0].int().tolist() == [[1, 0, 0], [0, 1, 0], [0, 1, 1]]
    assert seen[1, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    cache.extend(1)
    assert (cache.bias[:, 0] == 0).int().tolist() == [[[0, 1, 1, 1]], [[1, 1, 1, 1]]]
    with pytest.raises(ValueError, match="holds 4 tokens"):
        cache.extend(1)


def test_explicit_mask_runs_on_sdpa_only() -> None:
    q = k = v = torch.randn(1, 4, 2, 8)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()[None, None]
    torch.testing.assert_close(attention(q, k, v, mask=causal), attention(q, k, v))
    with pytest.raises(AttentionBackendError, match="sdpa"):
        attention(q, k, v, backend="flex", mask=causal)


def test_a_cache_refuses_packed_documents() -> None:
    model = tiny_model("llama3")
    ids = torch.tensor([[1, 2, 3]])
    docs = documents({"position_ids": torch.tensor([[0, 1, 0]])})
    with pytest.raises(ValueError, match="packed documents"):
        model(ids, cache=KVCache(torch.ones(1, 3, dtype=torch.bool), 2), docs=docs)


def tiny_hf_llama(folder: Path) -> tuple[LlamaForCausalLM, nn.Module]:
    """A tiny Llama (GQA, Llama 3 rope scaling) saved by transformers in ``folder``, and the
    same weights loaded with load_hf."""
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(folder)
    return hf, load_hf(folder)


def transformers_greedy(hf: LlamaForCausalLM, prompts: list[list[int]], new: int) -> list:
    """transformers' greedy ``generate`` on the left-padded prompts: the new ids per row."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
    return out[:, width:].tolist()


HF_PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [40, 41, 42, 43, 44]]


def test_greedy_equals_transformers_generate(tmp_path: Path) -> None:
    """Left-padded batch, same new ids as transformers' greedy generate."""
    hf, native = tiny_hf_llama(tmp_path)
    ours = generate(native, HF_PROMPTS, 10, pad_id=0)
    assert ours.tokens.tolist() == transformers_greedy(hf, HF_PROMPTS, 10)
