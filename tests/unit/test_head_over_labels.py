"""The fused LM head runs only over the positions that carry a label (prompts and padding
carry none), and the loss, the per-token log-probs, the entropy and every gradient equal the
previous computation over every position."""

from __future__ import annotations

import pytest
import torch

from temper.data.batch import IGNORE_INDEX
from temper.kernels.cross_entropy import linear_cross_entropy, linear_log_probs
from temper.kernels.dispatch import Kernels
from temper.models.qwen3.args import Qwen3Args
from temper.models.qwen3.model import Qwen3Transformer
from temper.objectives import causal_lm as causal_lm_module
from temper.objectives.causal_lm import CausalLM, CausalLMConfig, documents, label_log_probs

CHUNK = 5  # several chunks over the labelled rows and over all of them
KERNELS = Kernels(fused_cross_entropy=True, cross_entropy_chunk=CHUNK)
Z_LOSS = 1e-2


def _model() -> Qwen3Transformer:
    torch.manual_seed(0)
    args = Qwen3Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=64,
                     ffn_hidden_dim=48)  # fmt: skip
    model = Qwen3Transformer(args)
    model.init_weights()
    return model


def _batch(labelled: str) -> dict[str, torch.Tensor]:
    """Two rows of 12: chat-like (a 4-token prompt, a 5-token answer, 3 of padding) and two
    packed documents, each with a prompt; ``labelled`` "some", "all" or "none"."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 64, (2, 12), generator=gen)
    labels = torch.randint(0, 64, (2, 12), generator=gen)
    positions = torch.stack([torch.arange(12), torch.cat([torch.arange(7), torch.arange(5)])])
    if labelled == "some":
        labels[0, :4] = labels[0, 9:] = IGNORE_INDEX
        labels[1, :3] = labels[1, 7:9] = IGNORE_INDEX
    elif labelled == "none":
        labels[:] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def _grads(model: torch.nn.Module, value: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    value.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _rows_seen(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """The rows that each call of the chunked head ``name`` receives."""
    seen: list[int] = []
    head = getattr(causal_lm_module, name)

    def record(hidden: torch.Tensor, *args: object, **kwargs: object) -> object:
        seen.append(hidden.shape[0])
        return head(hidden, *args, **kwargs)

    monkeypatch.setattr(causal_lm_module, name, record)
    return seen


@pytest.mark.parametrize("labelled", ["some", "all", "none"])
def test_loss_and_gradients_equal_the_head_over_every_position(
    labelled: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CausalLM's loss against the previous code (the chunked head over all 24 positions)."""
    model, batch = _model(), _batch(labelled)
    labels = batch["labels"]
    hidden = model.hidden_states(batch["input_ids"], batch["position_ids"], documents(batch))
    weight = model.output.weight
    expected, expected_z = linear_cross_entropy(hidden, weight, labels, Z_LOSS, CHUNK)
    expected_grads = _grads(model, expected * 0.3)

    seen = _rows_seen(monkeypatch, "linear_cross_entropy")
    loss, count, metrics = CausalLM(CausalLMConfig(z_loss_weight=Z_LOSS), KERNELS).loss(
        model, batch
    )
    grads = _grads(model, loss * 0.3)
    assert seen == [{"some": 12, "all": 24, "none": 0}[labelled]] and count == seen[0]
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    if labelled == "none":
        assert loss == 0 and all(not grad.any() for grad in grads.values())
    else:
        torch.testing.assert_close(metrics["z_loss"] * count, expected_z, rtol=1e-6, atol=0)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("labelled", ["some", "none"])
def test_label_log_probs_and_entropy_equal_the_head_over_every_position(
    labelled: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GRPO's forward (temperature, entropy asked for) against the previous code: the same
    log-probs (0 where ignored) and gradients; the entropy at the labelled positions, the
    caller's values left elsewhere (GRPO reads it on completion tokens only)."""
    model, batch = _model(), _batch(labelled)
    ids, labels, positions = batch["input_ids"], batch["labels"], batch["position_ids"]
    docs, temperature = documents(batch), 0.7
    weigh = torch.randn(labels.shape, generator=torch.Generator().manual_seed(1))
    every_entropy = torch.zeros(labels.shape)
    hidden = model.hidden_states(ids, positions, docs) / temperature
    expected = linear_log_probs(hidden, model.output.weight, labels, CHUNK, entropy=every_entropy)[
        0
    ]
    expected_grads = _grads(model, (expected * weigh).sum())

    seen = _rows_seen(monkeypatch, "linear_log_probs")
    entropy = torch.full(labels.shape, -1.0)
    got = label_log_probs(
        model, ids, labels, positions, docs, temperature, entropy=entropy, kernels=KERNELS
    )
    grads = _grads(model, (got * weigh).sum())
    valid = labels != IGNORE_INDEX
    assert seen == [int(valid.sum())]
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert not got[~valid].any()
    torch.testing.assert_close(entropy[valid], every_entropy[valid], rtol=1e-6, atol=1e-6)
    assert (entropy[~valid] == -1).all()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-6, msg=name)
