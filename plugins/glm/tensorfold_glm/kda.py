"""KDA linear attention (`Glm5NextTextLinearAttention`, modeling_glm5_next.py 339-770), torch
reference: the CPU path.

Per stream, carried across passes in two slots: the conv tail (the last K-1 pre-conv q|k|v rows)
and the fp32 recurrent state S [heads, K, V]. The delta rule runs token by token (the
reference's recurrent form; its prefill uses the chunked form of the same recurrence, equal to
~1e-7 in fp32): each token's update is a fixed sequence of [heads, K, V] operations, so a row's
result and the state after it do not depend on where a pass cuts the prompt or on what else the
pass holds, and the state after any row can be tapped for the prompt store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from tensorfold.forward_pass import ForwardPass
from tensorfold.ops.conv import causal_conv, tails_at
from tensorfold.ops.linear import linear

from .config import GlmConfig
from .ops import sigmoid, silu
from .weights import KdaWeights

if TYPE_CHECKING:
    from tensorfold.adapters.stream_state import StreamSlots

L2_EPS = 1e-6


def forget_gate(cfg: GlmConfig, w: KdaWeights, x: torch.Tensor) -> torch.Tensor:
    """The per-channel log decay, fp32: lower_bound · sigmoid(exp(A_log) · (f_b f_a x + dt_bias)),
    or -exp(A_log) · softplus(·) without a lower bound. x [N, H] -> [N, heads, K]."""
    n = x.shape[0]
    g = (linear(linear(x, w.f_a), w.f_b).float() + w.dt_bias).view(n, cfg.linear_num_heads, -1)
    rate = w.decay[None, :, None]
    if cfg.linear_lower_bound is not None:
        return cfg.linear_lower_bound * sigmoid(rate * g)
    softplus = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
    return -rate * softplus


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(Σx² + 1e-6) over the last dimension (fla's form), fp32."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    tap_counts: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The gated delta rule over one stream's run, fp32.

    q, k [n, heads, K] (l2-normed, q scaled); v [n, heads, V]; g [n, heads, K] log decay;
    beta [n, heads]; state [heads, K, V]. Returns (o [n, heads, V], the state after the run,
    the state after the first `a` rows for each a in tap_counts)."""
    n = q.shape[0]
    out = q.new_empty(n, q.shape[1], v.shape[-1])
    decay = torch.exp(g)[..., None]  # [n, heads, K, 1]
    kk = k[..., None]  # [n, heads, K, 1]
    qq = q[..., None]
    bb = beta[..., None]  # [n, heads, 1]
    taps: dict[int, torch.Tensor] = {}
    wanted = set(tap_counts)
    if 0 in wanted:
        taps[0] = state.clone()
    for t in range(n):
        state = state * decay[t]
        delta = (v[t] - (state * kk[t]).sum(-2)) * bb[t]  # [heads, V]
        state = state + kk[t] * delta[:, None, :]
        out[t] = (state * qq[t]).sum(-2)
        if t + 1 in wanted:
            taps[t + 1] = state
    return out, state, [taps[a] for a in tap_counts]


def gated_norm(
    o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNormGated, all fp32: w · (o · rsqrt(mean o² + eps)) · sigmoid(gate), rounded to o's
    dtype. o, gate [N, heads, V]; weight [V]."""
    of = o.float()
    normed = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed * sigmoid(gate.float())).to(o.dtype)


def kda(
    cfg: GlmConfig, name: str, w: KdaWeights, x: torch.Tensor, fp: ForwardPass,
    slots: "StreamSlots",
) -> torch.Tensor:
    """The KDA mixer over a pass. x [N, H] (normed) -> [N, H]. Reads and leaves each stream's
    state in slots `{name}.conv` [slots, 3D, K-1] and `{name}.kda` [slots, heads, K, V]
    (zeros for a stream starting at row 0), and taps both at the stream's taps."""
    n, heads, dk = x.shape[0], cfg.linear_num_heads, cfg.linear_head_dim
    qkv = linear(x, w.qkv)  # [N, 3D]
    g = forget_gate(cfg, w, x)  # [N, heads, K] fp32
    beta = sigmoid(linear(x, w.b)).float()  # [N, heads], rounded to the model dtype first
    tails, states = slots.get(f"{name}.conv"), slots.get(f"{name}.kda")
    o = torch.empty(n, heads, dk, dtype=torch.float32, device=x.device)
    for i, (stream, (lo, hi)) in enumerate(zip(fp.streams, fp.spans)):
        fresh = stream.start == 0
        tail = torch.zeros_like(tails[stream.slot]) if fresh else tails[stream.slot]
        state = torch.zeros_like(states[stream.slot]) if fresh else states[stream.slot]
        counts = [p - stream.start for p in stream.taps]
        if counts:
            for p, tapped in zip(stream.taps, tails_at(qkv[lo:hi], tail, counts, w.conv.shape[1])):
                fp.tap(i, p, f"{name}.conv", tapped.clone())
        # The reference convolves in fp32 (its conv weight stays fp32), applies SiLU, and
        # rounds back to the model dtype.
        mixed, new_tail = causal_conv(qkv[lo:hi].float(), tail.float(), w.conv)
        tails[stream.slot] = new_tail.to(tails.dtype)
        q, k, v = silu(mixed).to(x.dtype).float().view(hi - lo, 3, heads, dk).unbind(1)
        o[lo:hi], states[stream.slot], tapped_states = delta_rule(
            l2norm(q) * dk**-0.5, l2norm(k), v, g[lo:hi], beta[lo:hi], state, counts
        )
        for p, tapped in zip(stream.taps, tapped_states):
            fp.tap(i, p, f"{name}.kda", tapped)
    gate = linear(linear(x, w.g_a), w.g_b).view(n, heads, dk)
    out = gated_norm(o.to(x.dtype), gate, w.o_norm, cfg.rms_norm_eps)
    return linear(out.reshape(n, -1), w.o)
