"""``fused_linears``: one product on stacked weights gives each plain layer's output and
gradients; any other kind of layer runs its own forward."""

from __future__ import annotations

import torch
from torch import nn

from temper.models.layers.fused_linear import fused_linears
from temper.models.lora import LoRALinear


def _layers() -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(32, n, bias=False) for n in (48, 16, 3)]


def test_plain_layers_fuse_into_one_product_with_their_outputs_and_gradients() -> None:
    layers = _layers()
    x = torch.randn(2, 5, 32, requires_grad=True)
    products = []

    def count(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        products.append(module)

    hooks = [layer.register_forward_hook(count) for layer in layers]
    fused = fused_linears(x, layers)
    assert not products  # no layer's own forward ran
    for hook in hooks:
        hook.remove()
    assert [t.shape[-1] for t in fused] == [48, 16, 3]
    sum((t * (i + 1)).sum() for i, t in enumerate(fused)).backward()
    fused_grads = [x.grad.clone()] + [layer.weight.grad.clone() for layer in layers]
    x.grad = None
    for layer in layers:
        layer.weight.grad = None
    separate = [layer(x) for layer in layers]
    for got, want in zip(fused, separate, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    sum((t * (i + 1)).sum() for i, t in enumerate(separate)).backward()
    grads = [x.grad] + [layer.weight.grad for layer in layers]
    for got, want in zip(fused_grads, grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_lora_or_biased_layer_runs_every_layers_own_forward() -> None:
    plain = _layers()
    torch.manual_seed(1)
    lora = LoRALinear(32, 16, bias=False, rank=2, alpha=4.0, dropout=0.0, rslora=False)
    with torch.no_grad():
        lora.lora_a.normal_()
        lora.lora_b.normal_()  # B starts at zero: make the adapter count
    biased = nn.Linear(32, 3)
    x = torch.randn(4, 32)
    for layers in ([plain[0], lora], [plain[0], biased]):
        for got, layer in zip(fused_linears(x, layers), layers, strict=True):
            assert torch.equal(got, layer(x))
