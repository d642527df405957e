"""KDA linear attention (`Glm5NextTextLinearAttention`, modeling_glm5_next.py 339-770), torch
reference: the CPU path.

Per stream, carried across passes in two slots: the conv tail (the last K-1 pre-conv q|k|v rows)
and the fp32 recurrent state S [heads, K, V]. The delta rule runs token by token (the
reference's recurrent form; its prefill uses the chunked form of the same recurrence, equal to
~1e-7 in fp32): each token's update is a fixed sequence of [heads, K, V] operations, so a row's
result and the state after it do not depend on where a pass cuts the prompt or on what else the
pass holds, and the state after any row can be tapped for the prompt store.

The GPU path (`use_triton`): the conv with SiLU, the gated norm and the recurrent delta rule
(decode rows and a prompt's rows outside its whole 64-row chunks, the forget gate, beta and the
q/k l2norm computed inside it) are Triton kernels (triton_kda.py); a prompt's whole chunks take
fla-core's `chunk_kda` (kda_launches.py says which row takes which, and why the gates hold).
fla-core is imported only there (never on the CPU); under the interpreter on the CPU a torch
stand-in runs the chunks. A decode pass and a uniform verify pass (ForwardPass.rows_each: every
stream k + 1 < 64 rows, all recurrent) run from the device meta alone, so a CUDA graph can replay
them; the verify pass taps its states by row (fp.tap_rows): the recurrent kernel writes each
row's state, the conv tails come from the rows themselves (`rows_each_by_row`).

Under tensor parallel a rank holds whole heads (shards.py): heads and D are read from the weights
(D = rows of qkv / 3, heads = rows of b), never from the config; o_proj sums the ranks' parts
(`row_linear`, the identity at one rank).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from tensorfold.family.forward_pass import ForwardPass, StackedTaps
from tensorfold.ops import switches
from tensorfold.ops.conv import causal_conv, tails_at, tails_each_row
from tensorfold.ops.gpu import use_triton
from tensorfold.ops.linear import linear, linear_groups
from tensorfold.ops.parallel import row_linear

from .config import GlmConfig
from .kda_launches import FlaKernels, TorchKernels, delta_rule_pass
from .layout import KDA_CHUNK as CHUNK
from .ops import sigmoid, silu
from .weights import KdaWeights

if TYPE_CHECKING:
    from tensorfold.adapters.stream_state import StreamSlots

L2_EPS = 1e-6


def forget_gate(cfg: GlmConfig, w: KdaWeights, x: torch.Tensor) -> torch.Tensor:
    """The per-channel log decay, fp32: lower_bound · sigmoid(exp(A_log) · (f_b f_a x + dt_bias)),
    or -exp(A_log) · softplus(·) without a lower bound. x [N, H] -> [N, heads, K]."""
    return log_decay(cfg, w, linear(linear(x, w.f_a), w.f_b))


def log_decay(cfg: GlmConfig, w: KdaWeights, pre: torch.Tensor) -> torch.Tensor:
    """forget_gate from f_b f_a x [N, D] (model dtype) -> [N, heads, K] fp32."""
    n = pre.shape[0]
    g = (pre.float() + w.dt_bias).view(n, heads_of(w), -1)
    rate = w.decay[None, :, None]
    if cfg.linear_lower_bound is not None:
        return cfg.linear_lower_bound * sigmoid(rate * g)
    softplus = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
    return -rate * softplus


def heads_of(w: KdaWeights) -> int:
    """This rank's KDA heads (all of them at one rank): the rows of b_proj."""
    return w.b.shape[0]


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
    cfg: GlmConfig,
    name: str,
    w: KdaWeights,
    x: torch.Tensor,
    fp: ForwardPass,
    slots: "StreamSlots",
) -> torch.Tensor:
    """The KDA mixer over a pass. x [N, H] (normed) -> [N, H]. Reads and leaves each stream's
    state in slots `{name}.conv` [slots, 3D, K-1] and `{name}.kda` [slots, heads, K, V]
    (zeros for a stream starting at row 0), and taps both at the stream's taps."""
    if use_triton(x):
        return _kda_kernels(cfg, name, w, x, fp, slots)
    n, heads, dk = x.shape[0], heads_of(w), cfg.linear_head_dim
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
    return row_linear(out.reshape(n, -1), w.o)


# -- the GPU path --------------------------------------------------------------------------------


def _kda_kernels(
    cfg: GlmConfig,
    name: str,
    w: KdaWeights,
    x: torch.Tensor,
    fp: ForwardPass,
    slots: "StreamSlots",
) -> torch.Tensor:
    """kda() through the kernels: a decode pass's layout from PassMeta alone (a CUDA graph
    reads nothing on the host); prompt passes plan their launches on the host."""
    from tensorfold.ops.pass_meta import pass_meta

    from . import triton_kda

    meta = pass_meta(fp)
    n, heads, dk = x.shape[0], heads_of(w), cfg.linear_head_dim
    qkv = linear(x, w.qkv)  # [N, 3D]
    tails, states = slots.get(f"{name}.conv"), slots.get(f"{name}.kda")
    r = rows_each_by_row(fp, x)
    if r:  # before the kernel moves them
        fp.tap_rows(f"{name}.conv", StackedTaps(tails_each_row(qkv, tails, meta, r)))
    else:
        _tap_tails(fp, f"{name}.conv", qkv, tails, w.conv.shape[1])
    q, k, v = triton_kda.conv_silu(
        qkv,
        tails,
        meta,
        w.conv,
        heads * dk,  # 3 x [N, D]
        one_row_each=meta.num_rows == meta.num_streams,
    )
    maps = linear(x, w.x_maps)  # [N, 2Dk + heads]: f_a x, g_a x, b x
    rank = w.f_a.shape[0]
    b = maps[:, 2 * rank :]
    # switches.GATE_MAPS_IN_ONE_LAUNCH: f_b of f_a x and g_b of g_a x, adjacent columns of one
    # product, in one launch (linear_groups); the joint weight's tiles and K split are not
    # f_b's: other bits, the same for a row in any pass. [2, N, D]: the forget gate before its
    # activation, the gate
    if switches.GATE_MAPS_IN_ONE_LAUNCH.on():
        pre, gate = linear_groups(maps[:, : 2 * rank], w.fg_b, 2)
    else:
        pre, gate = linear(maps[:, :rank], w.f_b), linear(maps[:, rank : 2 * rank], w.g_b)
    if meta.num_rows == meta.num_streams:
        o = _decode_rule(cfg, f"{name}.kda", w, q, k, v, pre, b, states, fp, meta)
    elif r:
        o = _verify_rule(cfg, f"{name}.kda", w, q, k, v, pre, b, states, fp, meta)
    else:
        # beta for the chunks (the recurrent rows' kernel takes b itself), rounded to the model
        # dtype as the reference; the chunks read fresh streams' states as zeros
        beta = triton_kda.sigmoid(b)  # [N, heads]
        triton_kda.zero_fresh(states, meta)
        kernels = (FlaKernels if x.is_cuda else TorchKernels)(cfg, w, heads)
        o = delta_rule_pass(kernels, q, k, v, pre, b, beta, states, fp, f"{name}.kda")
    out = triton_kda.gated_norm(
        o.view(n, heads, dk), gate.view(n, heads, dk), w.o_norm, cfg.rms_norm_eps
    )
    return row_linear(out.reshape(n, -1), w.o)


def _tap_tails(fp: ForwardPass, name: str, qkv: torch.Tensor, tails: torch.Tensor, k: int) -> None:
    for i, (stream, (lo, hi)) in enumerate(zip(fp.streams, fp.spans)):
        if not stream.taps:
            continue
        tail = torch.zeros_like(tails[stream.slot]) if stream.start == 0 else tails[stream.slot]
        counts = [p - stream.start for p in stream.taps]
        for p, tapped in zip(stream.taps, tails_at(qkv[lo:hi], tail, counts, k)):
            fp.tap(i, p, name, tapped.clone())


def rows_each_by_row(fp: ForwardPass, x: torch.Tensor) -> int | None:
    """R where the kernels path runs `fp` as a uniform verify pass from the device meta alone,
    its fixed states tapped by row (fp.tap_rows: what a CUDA graph replays): fp.rows_each below a
    64-row KDA chunk, so every row is recurrent (kda_launches.segments); else None (taps by
    position, the eager plan)."""
    r = fp.rows_each
    return r if r is not None and r < CHUNK and use_triton(x) else None


def _verify_rule(
    cfg: GlmConfig,
    name: str,
    w: KdaWeights,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pre: torch.Tensor,
    b: torch.Tensor,
    states: torch.Tensor,
    fp: ForwardPass,
    meta,
) -> torch.Tensor:
    """A uniform verify pass (fp.rows_each = R <= 17 rows a stream, fewer than a 64-row KDA
    chunk: every row recurrent, as kda_launches plans it), from PassMeta alone so a CUDA graph
    can hold it; the state after each stream's rows 1..R-1 tapped by row (fp.tap_rows), the
    bits the slot holds after those rows decoded one a pass. -> o [N, heads, V]."""
    from . import triton_kda

    r = rows_each_by_row(fp, q)
    assert r is not None
    n, n_streams = q.shape[0], meta.num_streams
    taps = fp.tap_space(name, states)  # [S, R-1, heads, K, V]: a GraphRunner's shared arena
    if switches.OWN_RECURRENT.on():  # one launch, the taps written by it
        out = _own_recurrent(cfg, w, q, k, v, pre, b, states, meta, taps)
    else:  # a launch a row (each stream's j-th), as decode rounds take them
        beta = triton_kda.sigmoid(b)
        triton_kda.zero_fresh(states, meta)
        rows = [t.view(n_streams, r, *t.shape[1:]) for t in (q, k, v, pre, beta)]
        out = q.new_empty(n_streams, r, heads_of(w), cfg.linear_head_dim)
        row = q.new_empty(n_streams, heads_of(w), cfg.linear_head_dim)
        for j in range(r):
            one = [t[:, j].contiguous() for t in rows]
            _one_row_each(cfg, w, *one, states, meta.stream_slot, row)
            out[:, j] = row
            if j < r - 1:
                taps[:, j] = states.index_select(0, meta.stream_slot.long())
        out = out.view(n, heads_of(w), cfg.linear_head_dim)
    fp.tap_rows(name, StackedTaps(taps))
    return out


def _own_recurrent(
    cfg: GlmConfig,
    w: KdaWeights,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pre: torch.Tensor,
    b: torch.Tensor,
    states: torch.Tensor,
    meta,
    taps: torch.Tensor | None = None,
) -> torch.Tensor:
    """The pass's runs through triton_kda.recurrent, laid out by PassMeta (slots updated in
    place; taps: None, or [S, R-1, heads, K, V] for each run's state after each row but its
    last). -> o [N, heads, V] in q's dtype."""
    from . import triton_kda

    out = torch.empty(q.shape[0], heads_of(w), cfg.linear_head_dim, dtype=q.dtype, device=q.device)
    triton_kda.recurrent(
        q,
        k,
        v,
        pre,
        b,
        w.a_log,
        w.dt_bias,
        cfg.linear_lower_bound,
        states,
        meta.stream_row0,
        meta.stream_len,
        meta.stream_start,
        meta.stream_slot,
        out,
        taps,
    )
    return out


def _decode_rule(
    cfg: GlmConfig,
    name: str,
    w: KdaWeights,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pre: torch.Tensor,
    b: torch.Tensor,
    states: torch.Tensor,
    fp: ForwardPass,
    meta,
) -> torch.Tensor:
    """A decode pass (every stream one row), read from PassMeta alone so a CUDA graph can hold
    it: one recurrent launch updating the slots in place (a fresh stream's state read as zeros).
    -> o [N, heads, V]."""
    from . import triton_kda

    n, heads, dk = q.shape[0], heads_of(w), cfg.linear_head_dim
    if switches.OWN_RECURRENT.on():
        out = _own_recurrent(cfg, w, q, k, v, pre, b, states, meta)
    else:
        out = torch.empty(n, heads, dk, dtype=q.dtype, device=q.device)
        beta = triton_kda.sigmoid(b)
        triton_kda.zero_fresh(states, meta)
        _one_row_each(cfg, w, q, k, v, pre, beta, states, meta.stream_slot, out)
    for i, stream in enumerate(fp.streams):  # a one-row run's tap is its end
        for p in stream.taps:
            fp.tap(i, p, name, states[stream.slot].clone())
    return out


def _one_row_each(
    cfg: GlmConfig,
    w: KdaWeights,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pre: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slot: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """One row a stream through fla-core's recurrent kernel (switches.OWN_RECURRENT off; on the
    CPU its packed stand-in), the states of `slot` [S] (device) read and left in place, fresh
    ones already zeroed; q, k, v, pre [S, heads·K] contiguous, beta [S, heads]; o written to
    out [S, heads, V] (contiguous)."""
    n, heads, dk = q.shape[0], heads_of(w), cfg.linear_head_dim
    if q.is_cuda:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        fused_recurrent_kda_fwd(
            q=q.view(n, 1, heads, dk),
            k=k.view(n, 1, heads, dk),
            v=v.view(n, 1, heads, dk),
            g=pre.view(n, 1, heads, dk),
            beta=beta.view(n, 1, heads),
            initial_state=states,
            inplace_final_state=True,
            ssm_state_indices=slot,
            out=out.view(n, 1, heads, dk),
            **FlaKernels(cfg, w, heads).common,
        )
    else:
        slots = slot.long()
        o, final = TorchKernels(cfg, w, heads).packed(
            q, k, v, pre, beta, states.index_select(0, slots), torch.arange(n + 1)
        )
        out.copy_(o)
        states.index_copy_(0, slots, final)
