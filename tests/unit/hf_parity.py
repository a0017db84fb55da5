"""Shared checks that a native family is the same function as its `transformers` class.

Families' tests build a tiny random HF model, save it with `save_pretrained`, load it
with `temper.models.load_hf`, then call these on the pair.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM

from temper.models import load_hf, save_hf
from temper.models.hf import adapter_of
from temper.models.safetensors_io import SafetensorsFolder


def randomize_norms(hf_model: nn.Module) -> None:
    """HF inits norm gains to 1; random gains catch a swapped or dropped norm key."""
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)


def earliest_first_topk(
    self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True
) -> torch.return_types.topk:
    """``Tensor.topk`` with equal values in index order, the tie rule of Temper's sparse
    selection (``select_top_k``). torch leaves topk's order among ties unspecified, and the
    sparse indexers' ReLU scores tie at exact zeros, so the DSA and V4 parity tests patch
    transformers' selection to this: the same function, with the ties decided alike."""
    order = self.sort(dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((self.gather(dim, order), order))


def max_rel_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def check_forward_and_grads(
    hf_model: nn.Module,
    native: nn.Module,
    *,
    seq_len: int = 24,
    logits_rtol: float = 1e-5,
    grad_rtol: float = 1e-4,
) -> dict[str, float]:
    """Same logits, same next-token loss, same gradient for every parameter.

    Returns the measured worst relative errors, so a test can report them.
    """
    vocab = native.tok_embeddings.num_embeddings
    ids = torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(0))
    hf_out = hf_model(ids, labels=ids)
    logits = native(ids)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    hf_loss = hf_out.loss
    if getattr(hf_out, "aux_loss", None) is not None:
        loss = loss + native.args.router_aux_loss_coef * native.aux_loss()
    hf_loss.backward()
    loss.backward()

    errors = {
        "logits": max_rel_err(logits.detach(), hf_out.logits.detach()),
        "loss": abs(loss.item() - hf_loss.item()) / abs(hf_loss.item()),
    }
    hf_grads = checkpoint_grads(hf_model)
    native_params = dict(native.named_parameters(remove_duplicate=False))
    worst_grad = 0.0
    for rule in adapter_of(native).key_rules(native.args):
        got = native_params[rule.native].grad
        if any(hf_grads[k] is None for k in rule.hf):
            # Computed without gradient in transformers (DSA's indexer): none here either.
            assert got is None, f"{rule.native} has a gradient; transformers' has none"
            continue
        expected = torch.stack([hf_grads[k] for k in rule.hf])
        expected = expected if len(rule.hf) > 1 else expected[0]
        err = max_rel_err(got, expected)
        assert err <= grad_rtol, f"gradient of {rule.native} off by {err:.2e} (relative)"
        worst_grad = max(worst_grad, err)
    errors["grad"] = worst_grad
    assert errors["logits"] <= logits_rtol, errors
    assert errors["loss"] <= 1e-6, errors
    return errors


def checkpoint_grads(hf_model: nn.Module) -> dict[str, torch.Tensor]:
    """HF gradients under checkpoint names: transformers 5 fuses MoE experts in memory
    (`experts.gate_up_proj` [E, 2I, D], `experts.down_proj` [E, D, I]) but saves one tensor per
    expert and projection. The fused names stay too, for families that save them fused
    (gpt-oss)."""
    grads = {name: param.grad for name, param in hf_model.named_parameters()}
    for name, param in hf_model.named_parameters():
        experts = name.rpartition(".")[0]
        if name.endswith("experts.gate_up_proj"):
            for e, (gate, up) in enumerate(zip(*param.grad.chunk(2, dim=1), strict=True)):
                grads[f"{experts}.{e}.gate_proj.weight"] = gate
                grads[f"{experts}.{e}.up_proj.weight"] = up
        elif name.endswith("experts.down_proj"):
            for e, down in enumerate(param.grad):
                grads[f"{experts}.{e}.down_proj.weight"] = down
    return grads


def check_round_trip(folder: Path, out: Path, hf_model: nn.Module) -> None:
    """HF -> Temper -> HF is bit-identical, and `transformers` loads what Temper wrote."""
    save_hf(load_hf(folder), out, max_shard_bytes=64 * 1024)
    original = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    written = SafetensorsFolder(out)
    assert written.keys() == sorted(original), set(written.keys()) ^ set(original)
    for key, tensor in original.items():
        assert torch.equal(written.read(key), tensor), key
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, hf_model.config.vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf_model(ids).logits, rtol=0, atol=0)
