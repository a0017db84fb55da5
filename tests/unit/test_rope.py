import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from temper.models.layers.rope import RopeScaling, apply_rope, rope_cos_sin, rope_inv_freq

LLAMA_3_1 = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def test_apply_rope_rotates_half_pairs_by_hand() -> None:
    # head_dim 4: dims (0, 2) rotate at frequency 1, dims (1, 3) at theta ** -0.5.
    theta, pos = 100.0, 3
    x = [0.5, -1.0, 2.0, 0.25]
    inv_freq = rope_inv_freq(4, theta)
    cos, sin = rope_cos_sin(inv_freq, torch.tensor([[pos]]))
    got = apply_rope(torch.tensor(x).view(1, 1, 1, 4), cos, sin).flatten().tolist()

    expected = [0.0] * 4
    for i, freq in enumerate((1.0, theta**-0.5)):
        c, s = math.cos(pos * freq), math.sin(pos * freq)
        a, b = x[i], x[i + 2]
        expected[i], expected[i + 2] = a * c - b * s, b * c + a * s
    assert got == pytest.approx(expected, abs=1e-6)


def test_rope_cos_sin_shape_and_zero_position_is_identity() -> None:
    cos, sin = rope_cos_sin(rope_inv_freq(8, 10000.0), torch.arange(5)[None].expand(2, 5))
    assert cos.shape == sin.shape == (2, 5, 8)
    x = torch.randn(2, 5, 3, 8)
    torch.testing.assert_close(apply_rope(x, cos, sin)[:, 0], x[:, 0])


def _llama3_by_hand(head_dim: int, theta: float, s: RopeScaling) -> tuple[list[float], list[str]]:
    values, bands = [], []
    for i in range(0, head_dim, 2):
        inv = theta ** (-i / head_dim)
        wavelen = 2 * math.pi / inv
        if wavelen < s.original_max_position_embeddings / s.high_freq_factor:
            values.append(inv)
            bands.append("high")
        elif wavelen > s.original_max_position_embeddings / s.low_freq_factor:
            values.append(inv / s.factor)
            bands.append("low")
        else:
            t = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            values.append((1 - t) * inv / s.factor + t * inv)
            bands.append("smooth")
    return values, bands


def test_llama3_scaling_matches_hand_formula_in_every_band() -> None:
    expected, bands = _llama3_by_hand(128, 500000.0, LLAMA_3_1)
    assert {"high", "smooth", "low"} == set(bands)
    got = rope_inv_freq(128, 500000.0, LLAMA_3_1).tolist()
    assert got == pytest.approx(expected, rel=1e-5)
    plain = rope_inv_freq(128, 500000.0).tolist()
    assert got[bands.index("high")] == plain[bands.index("high")]
    assert got[bands.index("low")] == pytest.approx(plain[bands.index("low")] / 8, rel=1e-6)


@pytest.mark.parametrize(
    ("head_dim", "theta", "scaling"),
    [(128, 500000.0, LLAMA_3_1), (64, 500000.0, RopeScaling(factor=32.0)), (16, 1e4, None)],
)
def test_inv_freq_equals_transformers(
    head_dim: int, theta: float, scaling: RopeScaling | None
) -> None:
    rope = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        rope |= {"rope_type": "llama3", **vars(scaling)}
    config = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        max_position_embeddings=131072,
        rope_parameters=rope,
    )
    init = (
        ROPE_INIT_FUNCTIONS["llama3"]
        if scaling
        else LlamaRotaryEmbedding.compute_default_rope_parameters
    )
    reference, _ = init(config, device=None)
    torch.testing.assert_close(rope_inv_freq(head_dim, theta, scaling), reference, rtol=0, atol=0)
