"""The gated delta rule (Gated DeltaNet's recurrence) behind the kernel dispatcher.

Per value head, a state S [d_k, d_v] is decayed, corrected towards the new value along the
new key, then read by the query (q and k L2-normalized, q scaled by d_k ** -0.5 beforehand):

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,   o_t = S_t^T q_t

``recurrent_gated_delta_rule`` steps it token by token (decoding, and the ground truth of the
tests). ``chunk_gated_delta_rule`` is the training form: within a chunk of C tokens the
sequential corrections are one unit-lower-triangular solve (the WY / UT transform), so a
chunk costs a few [C, C] and [C, d] matmuls and only the chunks are sequential. On CUDA the
``triton`` choice runs flash-linear-attention's chunked kernel when the ``fla`` package is
importable (an optional extra; the reference runs otherwise).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from temper.kernels.dispatch import Impl, choose

CHUNK = 64

GatedDeltaRule = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [b, s, h, d_k], v [b, s, h, d_v], g (log decay, <= 0) and beta [b, s, h] ->
    outputs [b, s, h, d_v] in v's dtype and the final state [b, h, d_k, d_v] in fp32 (fp64
    for fp64 inputs)."""
    dtype = v.dtype
    q, k, v, g, beta = (_at_least_fp32(t) for t in (q, k, v, g, beta))
    b, s, h, d_k = k.shape
    state = q.new_zeros(b, h, d_k, v.shape[-1]) if initial_state is None else initial_state.to(q)
    outs = []
    for t in range(s):
        state = state * g[:, t, :, None, None].exp()
        read = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = beta[:, t, :, None] * (v[:, t] - read)
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outs, dim=1).to(dtype), state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same inputs and outputs as ``recurrent_gated_delta_rule``, in chunks of ``chunk`` tokens.

    Within a chunk, with gamma the cumulative log decay and D[i, j] = exp(gamma_i - gamma_j)
    for j <= i: the corrections solve (I + tril(beta k k^T * D, -1)) [U | W] = [beta v |
    beta exp(gamma) k]; then with S the state entering the chunk, V' = U - W S,
    O = exp(gamma) q S + (q k^T * D) V', and S leaves as exp(gamma_C) S +
    (exp(gamma_C - gamma) k)^T V'. Padding the last chunk with k = v = 0, g = 0 changes nothing.
    """
    dtype = v.dtype
    s = q.shape[1]
    pad = -s % chunk
    # [b, h, n_chunks, chunk, ...] in fp32
    q, k, v = (_chunks(F.pad(_at_least_fp32(t), (0, 0, 0, 0, 0, pad)), chunk) for t in (q, k, v))
    g, beta = (_chunks(F.pad(_at_least_fp32(t), (0, 0, 0, pad)), chunk) for t in (g, beta))
    b, h, n, c, d_k = k.shape
    gamma = g.cumsum(dim=-1)
    future = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(future, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.mT) * decay  # solve_triangular reads the strict lower part only
    rhs = torch.cat([v * beta[..., None], k_beta * gamma.exp()[..., None]], dim=-1)
    u, w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split(
        [v.shape[-1], d_k], dim=-1
    )
    scores = (q @ k.mT) * decay
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]
    state = q.new_zeros(b, h, d_k, v.shape[-1]) if initial_state is None else initial_state.to(q)
    outs = []
    # unbind, not indexing: backward stacks the chunks' gradients once, where each index
    # would add a zero tensor the size of all chunks (quadratic in the chunk count).
    per_chunk = (t.unbind(2) for t in (u, w, q_decayed, scores, chunk_decay, k_to_end))
    for u_i, w_i, q_i, scores_i, decay_i, k_i in zip(*per_chunk, strict=True):
        v_new = u_i - w_i @ state
        outs.append(q_i @ state + scores_i @ v_new)
        state = state * decay_i + k_i.mT @ v_new
    out = torch.stack(outs, dim=2).flatten(2, 3)[:, :, :s]
    return out.transpose(1, 2).to(dtype), state


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """fp32 for half-precision inputs; fp64 stays (tests compare the two forms in it)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """[b, s, h, ...] (s a multiple of chunk) -> [b, h, s / chunk, chunk, ...], contiguous so
    the batched matmuls read it without a copy each."""
    x = x.transpose(1, 2).contiguous()
    return x.view(*x.shape[:2], -1, chunk, *x.shape[3:])


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    impl: Impl | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked rule through the dispatcher (``kernels.gated_delta``); ``impl`` is the
    form asked for (None: the reference)."""
    rule = choose("gated_delta", q.device, impl, chunk_gated_delta_rule, _fla)
    return rule(q, k, v, g, beta, initial_state)


@functools.cache
def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def _fla() -> GatedDeltaRule:
    """flash-linear-attention's chunked kernel with this module's conventions, or the
    reference (with a notice) when ``fla`` is not installed."""
    if not fla_installed():
        print(
            "temper: kernels.gated_delta=triton needs flash-linear-attention (pip install "
            "fla-core); using reference",
            file=sys.stderr,
        )
        return chunk_gated_delta_rule
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    def rule(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        initial_state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q arrives already scaled and both already normalized: scale 1, no in-kernel norm.
        out, state = fla_chunk(
            q,
            k,
            v,
            g.float(),
            beta,
            scale=1.0,
            initial_state=initial_state,
            output_final_state=True,
        )
        return out.to(v.dtype), state

    return rule
