"""GRPO against hand computations: advantages, the clipped loss and KL, rows built from a
rollout, rewards, prompt records, and a rollout whose recorded log-probabilities are the
trainer's."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from temper.config import Config, ConfigError, Data, Training
from temper.data.batch import IGNORE_INDEX
from temper.data.chat import BUILTIN_TEMPLATE, RecordError, stop_token_ids
from temper.data.prompts import decode_record, prompt_dataset, read_prompt_records
from temper.data.tokenizer import load_tokenizer
from temper.models import build_model, materialize
from temper.objectives.causal_lm import label_log_probs
from temper.objectives.grpo import GRPO, GRPOConfig, k3_kl
from temper.objectives.policy_loss import ADVANTAGE_EPS, clipped_loss, group_advantages
from temper.objectives.rewards import exact_match, item_match, list_format, register_reward
from temper.objectives.rollout import rollout_rows


def test_group_advantages_by_hand() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    got = group_advantages(rewards, group_size=4)
    std = math.sqrt((0.75**2 + 3 * 0.25**2) / 3)  # unbiased, mean 0.25
    want = [0.75 / (std + ADVANTAGE_EPS)] + [-0.25 / (std + ADVANTAGE_EPS)] * 3 + [0.0] * 4
    torch.testing.assert_close(got, torch.tensor(want))


def test_clipped_loss_and_k3_by_hand() -> None:
    old = torch.zeros(2, 3)
    new = torch.log(torch.tensor([[1.0, 1.5, 0.5], [1.0, 1.5, 0.5]]))
    adv = torch.tensor([2.0, -1.0])
    loss, clipped = clipped_loss(torch.exp(new - old), adv[:, None], 0.2, 0.2)
    # A > 0: min(r A, clip(r) A) caps r at 1.2; A < 0: it floors r at 0.8.
    want = torch.tensor([[-2.0, -2.4, -1.0], [1.0, 1.5, 0.8]])
    torch.testing.assert_close(loss, want)
    assert clipped.tolist() == [[False, True, False], [False, False, True]]
    ref = torch.log(torch.tensor([[2.0, 1.5, 0.25]]))
    x = torch.tensor([[2.0, 1.0, 0.5]])  # ref / new
    torch.testing.assert_close(k3_kl(new[:1], ref), x - torch.log(x) - 1)


def test_training_rows_train_on_the_completion_and_its_stop_token() -> None:
    prompts = [torch.tensor([7, 8, 9]), torch.tensor([4])]
    tokens = torch.tensor([[20, 21, 5, 0], [30, 31, 32, 33]])  # row 0 stopped on 5
    lengths = torch.tensor([3, 4])
    ids, labels = rollout_rows(prompts, tokens, lengths)  # as wide as row 0 needs: 3 + 3 - 1
    assert ids.tolist() == [[7, 8, 9, 20, 21], [4, 30, 31, 32, 0]]
    ig = IGNORE_INDEX
    assert labels.tolist() == [[ig, ig, 20, 21, 5], [30, 31, 32, 33, ig]]


def test_builtin_rewards_by_hand() -> None:
    def record(answer: str) -> dict[str, str]:
        return {"prompt": "q", "answer": answer}

    assert exact_match("", " a b c ", record("a b c")) == 1.0
    assert exact_match("", "a b", record("a b c")) == 0.0
    assert list_format("", "x y z", record("a b c")) == 1.0
    assert list_format("", "x y", record("a b c")) == 0.0
    assert list_format("", "xy z", record("ab c")) == 0.0
    assert item_match("", "1 2 9", record("1 2 3")) == pytest.approx(2 / 3)
    assert item_match("", "1 2 3 4", record("1 2 3")) == pytest.approx(3 / 4)
    assert item_match("", "", record("1 2")) == 0.0


def test_a_registered_reward_is_a_config_choice_and_an_unknown_one_fails() -> None:
    @register_reward("test_grpo_always_one")
    def always_one(prompt: str, completion: str, answer: str) -> float:
        return 1.0

    def config(rewards: list[str]) -> Config:
        return Config(
            training=Training(seq_len=48),
            data=Data(format="prompt"),
            objective=GRPOConfig(rewards=rewards, max_new_tokens=16),
        )

    config(["test_grpo_always_one", "exact_match"]).validate(1)
    with pytest.raises(ConfigError, match="objective.rewards: 'nope' not registered"):
        config(["nope"]).validate(1)
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_grpo_always_one")(always_one)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"objective": GRPOConfig(group_size=1)}, "objective.group_size must be >= 2"),
        (
            {"objective": GRPOConfig(max_new_tokens=64)},
            r"objective.max_new_tokens \(64\) must be below training.seq_len \(64\)",
        ),
        ({"data": Data(format="sft")}, "objective.name 'grpo' does not read data.format 'sft'"),
    ],
)
def test_bad_grpo_settings_fail_by_field(change: dict, message: str) -> None:
    fields = {
        "training": Training(seq_len=64),
        "data": Data(format="prompt"),
        "objective": GRPOConfig(),
    }
    with pytest.raises(ConfigError, match=message):
        Config(**(fields | change)).validate(1)


def test_prompt_records_rows_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "sort: 3 1 2", "answer": "1 2 3", "tests": [1, 2]},
        {"prompt": [{"role": "user", "content": "copy: é"}], "answer": "é"},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    records = read_prompt_records(str(path))
    tokenizer = load_tokenizer(None)
    stream = iter(prompt_dataset(records, tokenizer, BUILTIN_TEMPLATE, width=24))
    rows = [next(stream) for _ in range(2)]
    # Each row carries its whole record back, every field exact.
    got = sorted((decode_record(row["record_ids"]) for row in rows), key=lambda r: r["answer"])
    assert got == lines
    for row in rows:
        real = row["prompt_ids"][row["prompt_mask"]].tolist()
        assert row["prompt_mask"][-len(real) :].all()  # left-padded: prompts end together
        assert tokenizer.decode(real).endswith("<|assistant|>\n")
    path.write_text('{"prompt": "x"}\n{"answer": "y"}\n')
    with pytest.raises(RecordError, match=f"{path}:2: record has no field 'prompt'"):
        read_prompt_records(str(path))
    path.write_text('{"prompt": "x", "answer": 3}\n')
    with pytest.raises(RecordError, match=f"{path}:1: 'answer' must be a string"):
        read_prompt_records(str(path))


def _objective(reference: torch.nn.Module | None = None, **fields: Any) -> GRPO:
    tokenizer = load_tokenizer(None)
    defaults = dict(rewards=["exact_match", "item_match"], reward_weights=[1.0, 0.5], group_size=4)
    return GRPO(
        GRPOConfig(**(defaults | {"max_new_tokens": 8} | fields)),
        tokenizer=tokenizer,
        stop_tokens=stop_token_ids(tokenizer, BUILTIN_TEMPLATE),
        reference=reference,
    )


def _prompts() -> dict[str, torch.Tensor]:
    tokenizer = load_tokenizer(None)
    records = [
        ([{"role": "user", "content": "sort: 3 1 2"}], {"answer": "1 2 3"}),
        ([{"role": "user", "content": "copy: a b"}], {"answer": "a b"}),
    ]
    rows = iter(prompt_dataset(records, tokenizer, BUILTIN_TEMPLATE, width=20))
    batch = [next(rows) for _ in range(2)]
    return {key: torch.stack([row[key] for row in batch]) for key in batch[0]}


@pytest.mark.parametrize("family", ["llama3", "qwen3_5_moe"])
def test_rollout_records_the_trainers_log_probs_and_the_loss_is_the_formula(family: str) -> None:
    """Also for a Gated DeltaNet hybrid: its sampler decodes from the conv window and state
    (left-padded prompts), and the training forward recomputes the same log-probabilities."""
    torch.manual_seed(0)
    model = materialize(build_model(family, "debug"), torch.device("cpu"))
    objective = _objective()
    batch, metrics = objective.prepare(model, _prompts(), torch.Generator().manual_seed(0))
    completion = batch["labels"] != IGNORE_INDEX
    assert int(completion.sum()) > 0 and batch["input_ids"].shape[0] == 8
    assert "old_log_probs" not in batch  # the model sampled, one update: no forward for them
    assert batch["completion_lengths"].tolist() == completion.sum(dim=1).tolist()
    log_probs = label_log_probs(model, batch["input_ids"], batch["labels"])
    # The sampler's log-probabilities are the trainer forward's (fp32).
    torch.testing.assert_close(log_probs, batch["sampler_log_probs"], rtol=0, atol=1e-5)
    assert batch["advantages"].view(2, 4).sum(1).abs().max() < 1e-5  # centered per group
    # A random model earns no reward; the loss is checked on advantages of both signs.
    batch["advantages"] = torch.linspace(-1.0, 1.0, 8)

    # On-policy the ratio is 1: the loss is minus each token's row advantage.
    loss, count, step_metrics = objective.loss(model, batch)
    want = -(batch["advantages"][:, None] * completion).sum()
    assert count == completion.sum()
    assert loss.item() == pytest.approx(want.item(), rel=1e-4, abs=1e-5)
    assert step_metrics["clip_fraction"] == 0.0
    assert step_metrics["logprob_diff_max"] < 1e-5
    # The entropy, read from the loss's own (fused, chunked) forward, is the full logits'.
    with torch.no_grad():
        logits = model(batch["input_ids"]).float()
    entropy = logits.logsumexp(-1) - (logits.softmax(-1) * logits).sum(-1)
    assert step_metrics["entropy"].item() == pytest.approx(entropy[completion].mean().item())

    # Off-policy: old log-probs lowered by 0.5 make ratio e^0.5 > 1.2, clipped where A > 0.
    shifted = batch | {"old_log_probs": log_probs.detach() - 0.5}
    loss, _, step_metrics = objective.loss(model, shifted)
    adv = batch["advantages"][:, None].expand_as(completion)
    ratio = torch.exp(log_probs.detach() - shifted["old_log_probs"])
    per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    assert loss.item() == pytest.approx(per_token[completion].sum().item(), rel=1e-4)
    positive = (adv > 0) & completion
    assert step_metrics["clip_fraction"] == pytest.approx(
        positive.sum().item() / completion.sum().item()
    )


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_ignore_eos_decodes_every_completion_to_max_new_tokens(ignore_eos: bool) -> None:
    """A policy that all but always says the end-of-turn token first: it ends every completion
    after one token, unless objective.ignore_eos, when each row runs to max_new_tokens."""
    torch.manual_seed(0)
    model = materialize(build_model("llama3", "debug"), torch.device("cpu"))
    stops = stop_token_ids(load_tokenizer(None), BUILTIN_TEMPLATE)
    head = torch.nn.Linear(model.args.dim, model.args.vocab_size)
    head.weight.data.copy_(model.output.weight)
    head.bias.data.zero_()
    head.bias.data[sorted(stops)] = 30.0
    model.output = head
    objective = _objective(ignore_eos=ignore_eos)
    batch, _ = objective.prepare(model, _prompts(), torch.Generator().manual_seed(0))
    want = 8 if ignore_eos else 1
    assert batch["completion_lengths"].tolist() == [want] * 8


def test_the_section_goes_whole_to_the_sampler_and_a_kl_term_needs_a_reference() -> None:
    """GRPO hands its config section to the sampler as it is (one object, no copied fields),
    whose rewards are the registered ones it names; a KL term without a reference model or
    mode is refused at construction, not at the first rollout."""
    objective = _objective()
    assert objective.sampler.settings is objective.settings
    assert objective.sampler.rewards == {"exact_match": exact_match, "item_match": item_match}
    with pytest.raises(ValueError, match="kl_coef > 0 takes exactly one of a reference"):
        _objective(kl_coef=0.1)


def test_batch_scale_divides_by_the_std_of_the_whole_steps_rewards() -> None:
    """advantage_scale batch: each micro-batch keeps its group-centred advantages until the
    step's rollout is drawn, then all are divided by the std of every reward of the step
    (here two micro-batches, the data ranks' sum given as the identity)."""
    policy = GRPOConfig(advantage_scale="batch", max_new_tokens=8).policy_loss()
    objective = _objective(group_size=2, advantage_scale="batch")
    first, second = torch.tensor([1.0, 0.0, 2.0, 2.0]), torch.tensor([0.0, 4.0, 1.0, 1.0])
    batches = [{"rewards": r, "advantages": policy.advantages(r, 2)} for r in (first, second)]
    objective.finish_rollout(batches, lambda value: value)
    rewards = torch.cat([first, second])
    std = math.sqrt(((rewards - rewards.mean()) ** 2).sum().item() / 7)
    centred = [0.5, -0.5, 0.0, 0.0, -2.0, 2.0, 0.0, 0.0]
    got = torch.cat([batch["advantages"] for batch in batches])
    torch.testing.assert_close(got, torch.tensor(centred) / (std + ADVANTAGE_EPS))
    group = _objective(group_size=2)  # the default, group: finishing leaves them as they are
    kept = [{"rewards": first, "advantages": first.clone()}]
    group.finish_rollout(kept, lambda value: value)
    assert torch.equal(kept[0]["advantages"], first)


def test_kl_term_uses_the_reference_log_probs_and_adds_k3() -> None:
    torch.manual_seed(0)
    model = materialize(build_model("llama3", "debug"), torch.device("cpu"))
    torch.manual_seed(1)
    reference = materialize(build_model("llama3", "debug"), torch.device("cpu"))
    objective = _objective(reference, kl_coef=0.1)
    batch, _ = objective.prepare(model, _prompts(), torch.Generator().manual_seed(0))
    completion = batch["labels"] != IGNORE_INDEX
    with torch.no_grad():
        ref = label_log_probs(reference, batch["input_ids"], batch["labels"])
        own = label_log_probs(model, batch["input_ids"], batch["labels"])
    torch.testing.assert_close(batch["ref_log_probs"], ref, rtol=0, atol=1e-6)
    batch["advantages"] = torch.linspace(-1.0, 1.0, 8)

    loss, _, step_metrics = objective.loss(model, batch)
    delta = ref - own  # on-policy: log pi = old
    k3 = torch.exp(delta) - delta - 1
    policy = -(batch["advantages"][:, None] * completion).sum()
    want = policy + 0.1 * k3[completion].sum()
    assert k3[completion].mean() > 0.01  # two random models: the term is not negligible
    assert loss.item() == pytest.approx(want.item(), rel=1e-4)
    assert step_metrics["kl"] == pytest.approx(k3[completion].mean().item(), rel=1e-4)


@pytest.mark.parametrize("estimator", ["k3", "weighted_k3"])
@pytest.mark.parametrize("name", ["grpo", "dapo", "bnpo", "dr_grpo", "gspo"])
def test_loss_and_gradient_equal_the_formula_off_policy(name: str, estimator: str) -> None:
    """Each loss with each KL estimator, off-policy (old log-probs moved by a per-token
    offset, so some ratios clip), against the formula written out on the same forward's
    log-probs: the value and every parameter's gradient."""
    torch.manual_seed(0)
    model = materialize(build_model("llama3", "debug"), torch.device("cpu"))
    torch.manual_seed(1)
    reference = materialize(build_model("llama3", "debug"), torch.device("cpu"))
    objective = _objective(
        reference, kl_coef=0.1, kl_estimator=estimator, loss=name, clip_high=0.28
    )
    batch, _ = objective.prepare(model, _prompts(), torch.Generator().manual_seed(0))
    ids, labels = batch["input_ids"], batch["labels"]
    completion = labels != IGNORE_INDEX
    with torch.no_grad():
        own = label_log_probs(model, ids, labels)
    offset = 0.3 * torch.sin(torch.arange(ids.numel()).view(ids.shape).float())
    batch["old_log_probs"] = own + offset * completion
    batch["advantages"] = torch.linspace(-1.0, 1.0, 8)

    loss, count, _ = objective.loss(model, batch)
    (loss / count).backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    logp = label_log_probs(model, ids, labels)
    n = completion.sum(dim=1)
    delta = (logp - batch["old_log_probs"]) * completion
    if name == "gspo":  # one ratio per completion: the geometric mean of its tokens'
        ratio = torch.exp(delta.sum(dim=1) / n)[:, None].expand_as(logp)
    else:
        ratio = torch.exp(delta)
    adv = batch["advantages"][:, None]
    per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
    d = batch["ref_log_probs"] - logp
    kl = torch.exp(d) - d - 1
    per_token = (per_token + 0.1 * (kl * ratio if estimator == "weighted_k3" else kl)) * completion
    rows = per_token.shape[0]
    want = {
        "grpo": (per_token.sum(1) / n).sum() / rows,
        "gspo": (per_token.sum(1) / n).sum() / rows,
        "dapo": per_token.sum() / n.sum(),
        "bnpo": per_token.sum() / n.sum(),
        "dr_grpo": per_token.sum() / (rows * 8),
    }[name]
    assert (loss / count).item() == pytest.approx(want.item(), rel=1e-5)
    want.backward()
    for g, p in zip(got, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-7)
