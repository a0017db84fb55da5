"""Temper's SFT, DPO and GRPO numbers against TRL 1.16's, under the name mapping of
docs/post-training.md, on one tiny random Qwen3 saved with transformers and one batch: the
loss within 1e-6 and every weight's gradient (Temper's model against transformers' after TRL's
backward) within ``GRAD_RTOL``.

TRL's side is TRL's own code: `SFTTrainer` and `DPOTrainer` are instantiated on the folder's
model and tokenizer (fp32, CPU), their datasets prepared by TRL, their collators batch the
records and their ``compute_loss`` gives the loss (the DPO rewards are read from the metrics it
logs). For GRPO a `GRPOTrainer` is instantiated too and its ``_compute_loss`` is called on a
hand-built batch of completions, advantages and old/reference log-probs; its
``_generate_and_score_completions`` samples the completions whose rewards give the advantages
compared (the sampling itself is not). SimPO and ORPO call the experimental CPO and ORPO trainers'
functions with a stand-in ``self``. Temper's side is its data path (``tokenize_chat``, the
preference stream, ``sft_row``) and its objectives on the folder loaded with ``load_hf``. The
tokenizer is the built-in one with Qwen's ``<|im_start|>``/``<|im_end|>`` added, the template
Qwen's form.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from trl.experimental.cpo import CPOTrainer
from trl.experimental.orpo import ORPOTrainer

from temper.data.batch import IGNORE_INDEX
from temper.data.chat import Message, tokenize_chat
from temper.data.preference import preference_dataset
from temper.data.sft import pad_id, sft_row
from temper.data.tokenizer import load_tokenizer
from temper.models import load_hf
from temper.models.hf import adapter_of
from temper.objectives import CausalLM
from temper.objectives.dpo import DPO
from temper.objectives.dpo import DPOConfig as DPOSettings  # TRL's DPOConfig is imported too
from temper.objectives.grpo import GRPO
from temper.objectives.grpo import GRPOConfig as GRPOSettings
from temper.objectives.rollout import rollout_rows
from tests.unit.hf_parity import checkpoint_grads, max_rel_err, randomize_norms

TOLERANCE = 1e-6
GRAD_RTOL = 1e-5
"""Of each weight's largest gradient entry (measured: at most 1.3e-6)."""

QWEN = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QWEN_TAGGED = QWEN.replace(
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}",
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}",
)
"""The same template with the assistant's text marked, which TRL's ``assistant_only_loss``
needs (transformers' ``return_assistant_tokens_mask``)."""


def _turn(role: str, content: str) -> Message:
    return {"role": role, "content": content}


CHATS = [
    [_turn("system", "Answer briefly."), _turn("user", "sort: 3 1 2"), _turn("assistant", "1 2 3")],
    [
        _turn("user", "copy: a b"),
        _turn("assistant", "a b"),
        _turn("user", "copy: q w e r"),
        _turn("assistant", "q w e r"),
    ],
    [_turn("user", "sort: 9 8 7 6 5"), _turn("assistant", "5 6 7 8 9")],
]
PAIRS = [
    ([_turn("user", "sort: 3 1 2")], [_turn("assistant", "1 2 3")], [_turn("assistant", "1 3 2")]),
    # A multi-turn prompt holding an assistant turn: only the answers' tokens may count.
    (
        [
            _turn("system", "Answer briefly."),
            _turn("user", "copy: a b"),
            _turn("assistant", "a b"),
            _turn("user", "copy: c d"),
        ],
        [_turn("assistant", "c d")],
        [_turn("assistant", "c e")],
    ),
    ([_turn("user", "copy: x y")], [_turn("assistant", "x y")], [_turn("assistant", "y y z")]),
]


@pytest.fixture(scope="module")
def folder(
    tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer: Callable[[Path, str], int]
) -> Path:
    """A random tiny Qwen3 (random norm gains) and a tokenizer with Qwen's chat template."""
    path = tmp_path_factory.mktemp("qwen3_trl")
    vocab_size = qwen_tokenizer(path, QWEN_TAGGED)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        Qwen3Config(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
        )
    )
    randomize_norms(model)
    model.save_pretrained(path)
    return path


def _hf(folder: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _common(tmp_path: Path) -> dict[str, Any]:
    """TRL's settings for a deterministic CPU run in fp32 (TRL's configs default to bf16)."""
    return {
        "output_dir": str(tmp_path),
        "use_cpu": True,
        "bf16": False,
        "report_to": "none",
        "per_device_train_batch_size": 2,
    }


def _grad_error(hf_model: Any, native: torch.nn.Module) -> float:
    """The worst relative difference between Temper's gradient of each weight and
    transformers' after both backward passes."""
    hf_grads = checkpoint_grads(hf_model)
    params = dict(native.named_parameters(remove_duplicate=False))
    worst = 0.0
    for rule in adapter_of(native).key_rules(native.args):
        expected = torch.stack([hf_grads[key] for key in rule.hf]).squeeze(0)
        worst = max(worst, max_rel_err(params[rule.native].grad, expected))
    return worst


def _trimmed(row: torch.Tensor, width: int) -> list[int]:
    return row[:width].tolist()


@pytest.mark.parametrize("template", ["tagged", "plain"])
def test_sft_loss_and_labels_equal_trl(folder: Path, tmp_path: Path, template: str) -> None:
    """SFT with TRL's ``assistant_only_loss`` (generation blocks) against Temper's assistant
    labels, found from the tagged template's blocks or (``plain``) by rendering each turn:
    the same ids, the same trained tokens, and the same token-mean loss, for one padded row per
    conversation and for all three packed into one row."""
    trainer = SFTTrainer(
        model=_hf(folder),
        args=SFTConfig(**_common(tmp_path), assistant_only_loss=True, packing=False),
        train_dataset=Dataset.from_list([{"messages": chat} for chat in CHATS]),
        processing_class=AutoTokenizer.from_pretrained(folder),
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(CHATS))])
    trainer.model.eval()
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    theirs = loss.item()

    tokenizer = load_tokenizer(str(folder))
    samples = [
        tokenize_chat(tokenizer, QWEN_TAGGED if template == "tagged" else QWEN, chat)
        for chat in CHATS
    ]
    for i, (ids, trains) in enumerate(samples):
        assert _trimmed(batch["input_ids"][i], len(ids)) == ids
        trl_labels = _trimmed(batch["labels"][i], len(ids))
        assert trl_labels == [
            t if train else IGNORE_INDEX for t, train in zip(ids, trains, strict=True)
        ]
        assert (batch["labels"][i, len(ids) :] == IGNORE_INDEX).all()  # the rest is padding
        assert 0 < sum(trains) < len(ids)  # the prompts' tokens do not train, the answers' do
    width = sum(len(ids) for ids, _ in samples)
    fill = pad_id(tokenizer)
    padded = [sft_row([sample], width, fill, pack=False) for sample in samples]
    rows = {key: torch.stack([row[key] for row in padded]) for key in ("input_ids", "labels")}
    packed = {k: v.unsqueeze(0) for k, v in sft_row(samples, width, fill, pack=True).items()}
    native = load_hf(folder)
    for name, rows_batch in (("padded", rows), ("packed", packed)):
        native.zero_grad()
        loss_sum, tokens, _ = CausalLM().loss(native, rows_batch)
        (loss_sum / tokens).backward()
        ours = (loss_sum / tokens).item()
        assert ours == pytest.approx(theirs, abs=TOLERANCE), (name, ours, theirs)
        assert _grad_error(trainer.model, native) <= GRAD_RTOL, name


def _records(pairs: list[tuple[list[Message], ...]]) -> list[dict[str, list[Message]]]:
    return [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in pairs]


def _temper_pair_rows(folder: Path, seq_len: int) -> dict[str, torch.Tensor]:
    """Temper's DPO rows of PAIRS, in PAIRS' order (one stream a pair)."""
    tokenizer = load_tokenizer(str(folder))
    rows = []
    for pair in PAIRS:
        stream = preference_dataset([pair], tokenizer, QWEN, seq_len)
        rows.append(next(itertools.islice(iter(stream), 1)))
    keys = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
    return {key: torch.stack([row[key] for row in rows]) for key in keys}


DPO_CASES = {
    # Temper's --objective.loss_type -> TRL's DPOConfig fields
    "sigmoid": {"loss_type": ["sigmoid"]},
    "ipo_norm": {"loss_type": ["ipo"]},
    "rpo": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
}


@pytest.mark.parametrize("loss_type", list(DPO_CASES))
def test_dpo_loss_and_rewards_equal_trl(folder: Path, tmp_path: Path, loss_type: str) -> None:
    """Temper's preference loss and logged rewards against DPOTrainer's, policy and reference
    two different models, on three pairs, one with a multi-turn prompt holding an assistant
    turn: the same answer tokens (TRL's completion mask) and the same numbers. ``rpo`` matches
    TRL's ``sft`` term only when the chosen answers have one length (docs/post-training.md):
    that case runs on the two pairs whose chosen answers do."""
    pairs = PAIRS if loss_type != "rpo" else PAIRS[1:]
    beta = 0.3
    policy_hf, reference_hf = _hf(folder), _hf(folder)
    with torch.no_grad():  # a policy that differs from its reference: rewards are not 0
        for param in policy_hf.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    policy_hf.save_pretrained(tmp_path / "policy")
    trainer = DPOTrainer(
        model=policy_hf,
        ref_model=reference_hf,
        args=DPOConfig(**_common(tmp_path), beta=beta, **DPO_CASES[loss_type]),
        train_dataset=Dataset.from_list(_records(pairs)),
        processing_class=AutoTokenizer.from_pretrained(folder),
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(pairs))])
    trainer.model.eval()
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    theirs = loss.item()
    logged = {key: values[-1] for key, values in trainer._metrics["eval"].items()}

    width = batch["input_ids"].shape[1]
    rows = _temper_pair_rows(folder, width)
    if loss_type == "rpo":
        rows = {key: value[1:] for key, value in rows.items()}
        chosen_tokens = (rows["chosen_labels"] != IGNORE_INDEX).sum(dim=1)
        assert chosen_tokens.unique().numel() == 1, chosen_tokens  # the case's precondition
    n = len(pairs)
    for side, offset in (("chosen", 0), ("rejected", n)):
        trl_ids, trl_mask = batch["input_ids"][offset : offset + n], batch["completion_mask"]
        trl_mask = trl_mask[offset : offset + n]
        for i in range(n):
            labels = rows[f"{side}_labels"][i]
            length = int(batch["attention_mask"][offset + i].sum())
            assert _trimmed(rows[f"{side}_input_ids"][i], length - 1) == _trimmed(
                trl_ids[i], length - 1
            )
            # Temper's label at t is the token t + 1 where it trains; TRL's mask marks the token.
            expected = torch.where(trl_mask[i, 1:].bool(), trl_ids[i, 1:], IGNORE_INDEX)
            assert labels[: width - 1].tolist() == expected.tolist()
            assert (labels[width - 1 :] == IGNORE_INDEX).all()
    settings = DPOSettings(beta=beta, loss_type=loss_type, rpo_alpha=0.5)
    objective = DPO(settings, reference=load_hf(folder))
    native = load_hf(tmp_path / "policy")
    loss_sum, pairs_count, metrics = objective.loss(native, rows)
    (loss_sum / pairs_count).backward()
    ours = (loss_sum / pairs_count).item()
    assert ours == pytest.approx(theirs, abs=TOLERANCE)
    assert _grad_error(trainer.model, native) <= GRAD_RTOL
    for temper_name, trl_name in (
        ("rewards_chosen", "rewards/chosen"),
        ("rewards_rejected", "rewards/rejected"),
        ("reward_margin", "rewards/margins"),
        ("reward_accuracy", "rewards/accuracies"),
    ):
        assert metrics[temper_name].item() == pytest.approx(logged[trl_name], abs=TOLERANCE)
    assert logged["rewards/chosen"] != pytest.approx(0.0, abs=1e-3)  # the comparison has teeth


@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_reference_free_losses_equal_trl(folder: Path, loss_type: str) -> None:
    """SimPO and ORPO against TRL's experimental CPO and ORPO trainers' own functions, called
    with a stand-in ``self`` (the trainers tokenize their own way, so the rows are Temper's,
    whose tokens the DPO test holds to DPOTrainer's): ``get_batch_logps`` (answer-token means)
    on transformers' logits, then ``CPOTrainer.cpo_loss`` (``loss_type="simpo"``,
    ``cpo_alpha=0``) or ``ORPOTrainer.odds_ratio_loss``: the loss, its gradient and the
    rewards. ORPO's NLL term is the paper's, each
    chosen answer's token mean, averaged over pairs: TRL's trainer takes it over the prompt's
    tokens too (docs/post-training.md), so that term is built here from TRL's answer means."""
    beta, gamma = 0.3, 0.4
    rows = _temper_pair_rows(folder, 160)
    input_ids = torch.cat([rows["chosen_input_ids"], rows["rejected_input_ids"]])
    shifted = torch.cat([rows["chosen_labels"], rows["rejected_labels"]])
    labels = torch.cat([torch.full_like(shifted[:, :1], IGNORE_INDEX), shifted[:, :-1]], dim=1)
    assert (shifted[:, -1] == IGNORE_INDEX).all()  # nothing lost by the unshift
    hf_model = _hf(folder)
    logits = hf_model(input_ids).logits
    average = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    n = len(PAIRS)
    stand_in = SimpleNamespace(
        alpha=0.0,
        beta=beta,
        loss_type="simpo",
        simpo_gamma=gamma,
        label_smoothing=0.0,
        accelerator=SimpleNamespace(device=torch.device("cpu")),
    )
    if loss_type == "simpo":
        losses, chosen, rejected = CPOTrainer.cpo_loss(stand_in, average[:n], average[n:])
        theirs = losses.mean()
    else:
        odds, chosen, rejected, _, _ = ORPOTrainer.odds_ratio_loss(
            stand_in, average[:n], average[n:]
        )
        theirs = -average[:n].mean() - odds.mean()
    theirs.backward()
    objective = DPO(DPOSettings(beta=beta, loss_type=loss_type, simpo_gamma=gamma))
    native = load_hf(folder)
    loss_sum, pairs_count, metrics = objective.loss(native, rows)
    (loss_sum / pairs_count).backward()
    assert (loss_sum / pairs_count).item() == pytest.approx(theirs.item(), abs=TOLERANCE)
    assert _grad_error(hf_model, native) <= GRAD_RTOL
    assert metrics["rewards_chosen"].item() == pytest.approx(chosen.mean().item(), abs=TOLERANCE)
    assert metrics["rewards_rejected"].item() == pytest.approx(
        rejected.mean().item(), abs=TOLERANCE
    )


# GRPO: Temper's --objective.loss -> TRL's GRPOConfig fields (docs/post-training.md)
GRPO_CASES = {
    "grpo": {"loss_type": "grpo"},
    "dapo": {"loss_type": "dapo"},
    "bnpo": {"loss_type": "bnpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
}
KL = {"none": (0.0, "k3"), "k3": (0.04, "k3"), "weighted_k3": (0.04, "weighted_k3")}
MAX_NEW_TOKENS = 6
TEMPERATURE = 0.7


def _grpo_batch(vocab: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """TRL's batch of four completions, of 6, 3, 5 and 2 tokens (right-padded), of two prompts
    of 5 and 3 tokens (left-padded, as TRL pads them), with advantages of both signs; and the
    rows' prompts unpadded."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, vocab, (n,), generator=gen) for n in (5, 5, 3, 3)]
    prompts[1], prompts[3] = prompts[0], prompts[2]  # a group shares its prompt
    prompt_ids = torch.zeros(4, 5, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for i, prompt in enumerate(prompts):
        prompt_ids[i, 5 - prompt.numel() :] = prompt
        prompt_mask[i, 5 - prompt.numel() :] = 1
    lengths = torch.tensor([6, 3, 5, 2])
    batch = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(5, vocab, (4, MAX_NEW_TOKENS), generator=gen),
        "completion_mask": (torch.arange(MAX_NEW_TOKENS)[None] < lengths[:, None]).long(),
        "advantages": torch.tensor([0.9, -0.9, 1.3, -0.4]),
    }
    return batch, prompts


def _old_and_ref(log_probs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Old and reference log-probs near the policy's, off by up to +-0.4 per token, so some
    ratios leave the clip range on both sides."""
    gen = torch.Generator().manual_seed(4)
    old = log_probs + (torch.rand(log_probs.shape, generator=gen) - 0.5) * 0.8
    ref = log_probs + (torch.rand(log_probs.shape, generator=gen) - 0.5) * 0.8
    return old * mask, ref * mask


def _rows_of(batch: dict[str, torch.Tensor], part: int, rows: int) -> dict[str, torch.Tensor]:
    """Micro-batch ``part`` of ``rows`` rows."""
    return {key: value[part * rows : (part + 1) * rows] for key, value in batch.items()}


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("kl", list(KL))
@pytest.mark.parametrize("loss", list(GRPO_CASES))
def test_grpo_loss_equals_trl(
    folder: Path, tmp_path: Path, loss: str, kl: str, micro_batches: int
) -> None:
    """Temper's GRPO step loss (each micro-batch's loss sum over the step's count, summed)
    against ``GRPOTrainer._compute_loss`` summed over the step's micro-batches (TRL's training
    mode, ``gradient_accumulation_steps`` = ``micro_batches``) on the same completions,
    advantages, old and reference log-probs, sampling temperature and clip range (0.2 low,
    0.28 high), for every loss name with a TRL counterpart and each KL setting: the value and
    every weight's gradient. Prompts of two lengths: TRL's rows left-pad them, Temper's are
    laid out by ``rollout_rows``."""
    kl_coef, estimator = KL[kl]
    trl_batch, prompts = _grpo_batch(AutoTokenizer.from_pretrained(folder).vocab_size)
    rows = trl_batch["prompt_ids"].shape[0] // micro_batches
    trainer = GRPOTrainer(
        model=_hf(folder),
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=GRPOConfig(
            **_common(tmp_path) | {"per_device_train_batch_size": rows},
            gradient_accumulation_steps=micro_batches,
            num_generations=2,
            max_completion_length=MAX_NEW_TOKENS,
            temperature=TEMPERATURE,
            epsilon=0.2,
            epsilon_high=0.28,
            beta=kl_coef,
            use_bias_correction_kl=estimator == "weighted_k3",
            **GRPO_CASES[loss],
        ),
        train_dataset=Dataset.from_list([{"prompt": "sort: 3 1 2"}] * 4),
        processing_class=AutoTokenizer.from_pretrained(folder),
    )
    trainer.model.train()  # from_pretrained leaves it in eval mode, where TRL does not accumulate
    trainer.current_gradient_accumulation_steps = micro_batches  # set by TRL's training loop
    mask = trl_batch["completion_mask"].bool()
    lengths = mask.sum(dim=1)
    # Temper's rows as its rollouts lay them out: each prompt, then its completion, right-padded.
    input_ids, labels = rollout_rows(prompts, trl_batch["completion_ids"], lengths)
    starts = [prompt.numel() - 1 for prompt in prompts]  # where each row's first label sits

    def _spread(per_token: torch.Tensor) -> torch.Tensor:
        """[b, MAX_NEW_TOKENS] in TRL's completion columns -> [b, width] in Temper's rows."""
        out = torch.zeros(input_ids.shape)
        for i, (start, n) in enumerate(zip(starts, lengths.tolist(), strict=True)):
            out[i, start : start + n] = per_token[i, :n]
        return out

    native = load_hf(folder)
    with torch.no_grad():
        logits = native(input_ids) / TEMPERATURE
        own = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    policy = torch.zeros(mask.shape)
    for i, (start, n) in enumerate(zip(starts, lengths.tolist(), strict=True)):
        policy[i, :n] = own[i, start : start + n]
    assert torch.equal(_spread(policy), own.masked_fill(labels == IGNORE_INDEX, 0.0))
    old, ref = _old_and_ref(policy, mask)
    trl_batch |= {"old_per_token_logps": old, "ref_per_token_logps": ref}
    theirs = 0.0
    for part in range(micro_batches):
        # TRL's dapo divides by the whole generation batch's completion tokens.
        chunk = _rows_of(trl_batch, part, rows) | {"num_items_in_batch": mask.sum()}
        trl_loss = trainer._compute_loss(trainer.model, chunk)
        trl_loss.backward()
        theirs += trl_loss.item()

    settings = GRPOSettings(
        group_size=2,
        max_new_tokens=MAX_NEW_TOKENS,
        temperature=TEMPERATURE,
        clip_eps=0.2,
        clip_high=0.28,
        loss=loss,
        kl_coef=kl_coef,
        kl_estimator=estimator,
        updates_per_rollout=2,
    )
    objective = GRPO(
        settings,
        tokenizer=load_tokenizer(str(folder)),
        stop_tokens=set(),
        reference=load_hf(folder) if kl_coef else None,
    )
    batch = {
        "input_ids": input_ids,
        "labels": labels,
        "advantages": trl_batch["advantages"],
        "old_log_probs": _spread(old),
        "sampler_log_probs": _spread(old),
        "ref_log_probs": _spread(ref),
        "completion_lengths": lengths,
    }
    parts = [_rows_of(batch, i, rows) for i in range(micro_batches)]
    step_count = sum(objective.count(part) for part in parts)  # the trainer's global count
    ours, clipped = 0.0, []
    for part in parts:
        loss_sum, _, metrics = objective.loss(native, part)
        (loss_sum / step_count).backward()
        ours += (loss_sum / step_count).item()
        clipped.append(metrics["clip_fraction"].item())
    assert ours == pytest.approx(theirs, abs=TOLERANCE), (ours, theirs)
    assert max(clipped) > 0 and min(clipped) < 1  # the clip decides for some units, not all
    assert _grad_error(trainer.model, native) <= GRAD_RTOL


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_advantages_equal_trl(folder: Path, tmp_path: Path, scale: str) -> None:
    """``--objective.advantage_scale`` against TRL's ``scale_rewards`` of the same name: TRL
    samples two groups of four completions (``_generate_and_score_completions``, transformers'
    ``generate``), and Temper's advantages (``PolicyLoss.advantages``, then
    ``GRPO.finish_rollout`` on one micro-batch and one rank) of the rewards TRL's reward
    function gave equal TRL's."""
    given: list[float] = []

    def reward(completions: list[Any], **kwargs: Any) -> list[float]:
        scores = [float(len(completion[0]["content"]) % 5) for completion in completions]
        given.extend(scores)
        return scores

    prompts = [[_turn("user", "sort: 3 1 2")], [_turn("user", "copy: a b")]]
    trainer = GRPOTrainer(
        model=_hf(folder),
        reward_funcs=reward,
        args=GRPOConfig(
            **_common(tmp_path) | {"per_device_train_batch_size": 8},
            num_generations=4,
            max_completion_length=MAX_NEW_TOKENS,
            scale_rewards=scale,
        ),
        train_dataset=Dataset.from_list([{"prompt": prompt} for prompt in prompts]),
        processing_class=AutoTokenizer.from_pretrained(folder),
    )
    torch.manual_seed(5)
    rows = [trainer.train_dataset[i] for i in (0, 0, 0, 0, 1, 1, 1, 1)]
    theirs = trainer._generate_and_score_completions(rows)["advantages"]
    rewards = torch.tensor(given)
    assert len(set(given[:4])) > 1 and len(set(given[4:])) > 1  # both groups teach something

    settings = GRPOSettings(group_size=4, max_new_tokens=MAX_NEW_TOKENS, advantage_scale=scale)
    objective = GRPO(settings, tokenizer=load_tokenizer(str(folder)), stop_tokens=set())
    batch = {"advantages": objective.policy_loss.advantages(rewards, 4), "rewards": rewards}
    objective.finish_rollout([batch], lambda sums: sums)
    torch.testing.assert_close(batch["advantages"], theirs, rtol=0, atol=TOLERANCE)
