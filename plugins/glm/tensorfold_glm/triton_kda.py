"""The KDA mixer's own Triton kernels (the GPU path), beside their torch references in kda.py and
tensorfold.ops.conv: the short conv with SiLU over a whole pass, its tails, the zeroing of fresh
streams' recurrent states, the gated output norm, beta's sigmoid (one launch where torch takes
six), and the delta rule's recurrent rows (`recurrent`; its reference is kda.delta_rule through
kda_launches.TorchKernels.packed). A prompt's whole chunks are fla-core's `chunk_kda`.

Every output is a function of its own row's inputs (and its stream's tail), computed in an order
fixed by the widths alone, so no row depends on the other rows of the pass or where it was cut.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorfold.ops import switches
from tensorfold.ops.gpu import launch_options
from tensorfold.ops.pass_meta import PassMeta
from tensorfold.ops.triton_conv import tail_kernel
from tensorfold.ops.triton_util import after_prior, cdiv, next_power_of_2

ROWS = 16
CHANNELS = 128
ZERO_BLOCK = 4096


@triton.jit(do_not_specialize=["n_rows"])  # one binary for any row count
def _conv_silu_kernel(
    u_ptr,
    tail_ptr,
    w_ptr,
    out_ptr,
    row_stream,
    stream_row0,
    stream_start,
    stream_slot,
    n_rows,
    C,
    D,
    stride_u,
    stride_ts,
    K: tl.constexpr,
    ROWS: tl.constexpr,
    CH: tl.constexpr,
    ONE_ROW_EACH: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    after_prior(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ch = tl.program_id(1) * CH + tl.arange(0, CH)
    rmask = rows < n_rows
    cmask = ch < C
    s = tl.load(row_stream + rows, mask=rmask, other=0)
    local = rows - tl.load(stream_row0 + s, mask=rmask, other=0)
    fresh = tl.load(stream_start + s, mask=rmask, other=0) == 0
    slot = tl.load(stream_slot + s, mask=rmask, other=0).to(tl.int64)
    acc = tl.zeros((ROWS, CH), dtype=tl.float32)
    for j in tl.static_range(K):
        e = local + j  # index into ext = tail (K-1 columns) ++ the run
        from_u = e >= K - 1
        src = (rows + j - (K - 1)).to(tl.int64)
        m_u = (rmask & from_u)[:, None] & cmask[None, :]
        u = tl.load(u_ptr + src[:, None] * stride_u + ch[None, :], mask=m_u, other=0.0)
        m_t = (rmask & ~from_u & ~fresh)[:, None] & cmask[None, :]
        t_ptrs = tail_ptr + slot[:, None] * stride_ts + ch[None, :] * (K - 1) + e[:, None]
        tail = tl.load(t_ptrs, mask=m_t, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + ch * K + j, mask=cmask, other=0.0).to(tl.float32)
        tap = tl.where(from_u[:, None], u.to(tl.float32), tail)
        if j == 0:
            acc = tap * w[None, :]
        else:
            acc = acc + tap * w[None, :]
            if ONE_ROW_EACH:  # the row is its stream's run (e == j): tap j is the new tail's
                # j-1, stored where tap j-1 was read (by every thread, before the barrier); the
                # tail's dtype is qkv's, so the tap is the value tail_kernel would store
                tl.debug_barrier()
                tl.store(
                    t_ptrs - 1,
                    tap.to(tail_ptr.dtype.element_ty),
                    mask=rmask[:, None] & cmask[None, :],
                )
    y = acc / (1.0 + tl.exp(-acc))  # SiLU in fp32, as ops.moe.silu
    which = (ch // D).to(tl.int64)  # q, k or v: out is [3, N, D]
    offs = which[None, :] * n_rows * D + rows.to(tl.int64)[:, None] * D + (ch % D)[None, :]
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def conv_silu(
    qkv: torch.Tensor,
    tails: torch.Tensor,
    meta: PassMeta,
    weight: torch.Tensor,
    d: int,
    one_row_each: bool = False,
) -> torch.Tensor:
    """SiLU(causal conv) of a pass's q|k|v rows, each stream continuing its tail.

    qkv [N, 3D] (the projections, model dtype); tails [slots, 3D, K-1] (read, zeros for a stream
    starting at row 0, then moved on in place); weight [3D, K] fp32; one_row_each: every stream
    of the pass has one row (a decode pass). Returns [3, N, D]: q, k, v, each contiguous,
    rounded to qkv's dtype (the reference: fp32 conv, fp32 SiLU, rounded)."""
    n, c = qkv.shape
    k = weight.shape[1]
    qkv = qkv.contiguous()
    out = torch.empty(3, n, d, dtype=qkv.dtype, device=qkv.device)
    if n == 0:
        return out
    in_place = (
        one_row_each and switches.KDA_TAIL_IN_PLACE.on() and k >= 2 and tails.dtype == qkv.dtype
    )
    _conv_silu_kernel[(cdiv(n, ROWS), cdiv(c, CHANNELS))](
        qkv,
        tails,
        weight.contiguous(),
        out,
        meta.row_stream,
        meta.stream_row0,
        meta.stream_start,
        meta.stream_slot,
        n,
        c,
        d,
        qkv.stride(0),
        tails.stride(0),
        K=k,
        ROWS=ROWS,
        CH=CHANNELS,
        ONE_ROW_EACH=in_place,
        num_warps=4,
        **launch_options(qkv),
    )
    if in_place:
        return out
    tail_kernel[(meta.num_streams, cdiv(c, CHANNELS))](
        qkv,
        tails,
        meta.stream_row0,
        meta.stream_len,
        meta.stream_start,
        meta.stream_slot,
        c,
        qkv.stride(0),
        tails.stride(0),
        K=k,
        KP=next_power_of_2(max(k - 1, 1)),
        CH=CHANNELS,
        GATED=False,
        num_warps=4,
        **launch_options(qkv),
    )
    return out


@triton.jit
def _zero_fresh_kernel(
    state_ptr,
    stream_start,
    stream_slot,
    size,
    stride_s,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    after_prior(PDL)
    s = tl.program_id(0)
    if tl.load(stream_start + s) == 0:
        slot = tl.load(stream_slot + s).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        zero = tl.zeros((BLOCK,), dtype=state_ptr.dtype.element_ty)
        tl.store(state_ptr + slot * stride_s + offs, zero, mask=offs < size)


def zero_fresh(states: torch.Tensor, meta: PassMeta) -> None:
    """Zero the slots of the pass's streams that start at row 0, on the device (no host read of
    the starts: a decode pass under a CUDA graph may hold a one-row prompt). states [slots, ...]
    contiguous per slot."""
    size = states[0].numel()
    _zero_fresh_kernel[(meta.num_streams, cdiv(size, ZERO_BLOCK))](
        states,
        meta.stream_start,
        meta.stream_slot,
        size,
        states.stride(0),
        BLOCK=ZERO_BLOCK,
        num_warps=4,
        **launch_options(states),
    )


@triton.jit(do_not_specialize=["n_rows"])
def _sigmoid_kernel(
    x_ptr,
    out_ptr,
    n_rows,
    C,
    stride_x,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr = False,
):
    after_prior(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < C)
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = 1.0 / (1.0 + tl.exp(-x))
    tl.store(out_ptr + r64 * C + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) in fp32, rounded to x's dtype (ops.moe.sigmoid). x [N, C], its rows
    strided (a slice of a wider product's columns) -> [N, C] contiguous."""
    n, c = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(n, c, dtype=x.dtype, device=x.device)
    block_c = next_power_of_2(c)
    per = max(1, min(64, 4096 // block_c))
    if n:
        _sigmoid_kernel[(cdiv(n, per),)](
            x, out, n, c, x.stride(0), ROWS=per, BLOCK_C=block_c, num_warps=4, **launch_options(x)
        )
    return out


@triton.jit(do_not_specialize=["n_groups"])
def _gated_norm_kernel(
    o_ptr,
    gate_ptr,
    w_ptr,
    out_ptr,
    n_groups,
    V,
    eps,
    ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr = False,
):
    after_prior(PDL)
    groups = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_V)
    mask = (groups[:, None] < n_groups) & (cols[None, :] < V)
    offs = groups.to(tl.int64)[:, None] * V + cols[None, :]
    o = tl.load(o_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(o * o, axis=1) / V
    normed = o * tl.math.rsqrt(var + eps)[:, None]
    g = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
    y = w[None, :] * normed * (1.0 / (1.0 + tl.exp(-g)))
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_norm(
    o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNormGated per head, all fp32, rounded to o's dtype (kda.gated_norm).
    o, gate [N, heads, V] (any leading shape with V last, contiguous); weight [V] -> o's shape."""
    v = o.shape[-1]
    o = o.contiguous()
    gate = gate.contiguous()
    out = torch.empty_like(o)
    groups = o.numel() // v
    block_v = next_power_of_2(v)
    per = max(1, min(64, 4096 // block_v))
    if groups:
        _gated_norm_kernel[(cdiv(groups, per),)](
            o,
            gate,
            weight.contiguous(),
            out,
            groups,
            v,
            eps,
            ROWS=per,
            BLOCK_V=block_v,
            num_warps=4,
            **launch_options(o),
        )
    return out


# The delta rule's recurrent rows (a decode row, a prompt's rows outside its whole 64-row
# chunks): a program a (run, head, VALUE_BLOCK columns of V) keeps its [K, VALUE_BLOCK] slice of
# the fp32 state in registers through the run's rows, reading and leaving it in the stream's
# slot. Fixed by the widths alone (never the row or run count), so a row's bits are the same in
# a decode pass, a prompt's pass or any batch. Where fla-core's recurrent kernel took the
# sigmoid of beta, the zeroing of fresh states and a launch of its own outside the dependent
# chain, this takes b before its sigmoid and the stream's start position.
# Used where switches.OWN_RECURRENT is on; off: fla-core's fused_recurrent_kda on packed copies
# (on the CPU kda_launches.TorchKernels' stand-in).
VALUE_BLOCK = 32
RECURRENT_WARPS = 4


@triton.jit
def _recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pre_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    state_ptr,
    out_ptr,
    run_row0,
    run_len,
    run_start,
    run_slot,
    taps_ptr,
    lower_bound,
    scale,
    stride_pre,
    stride_b,
    stride_tap_run,
    HEADS: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    LOWER: tl.constexpr,
    TAPS: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    after_prior(PDL)
    run = tl.program_id(0)
    h = tl.program_id(1)
    kk = tl.arange(0, BK)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    kmask = kk < DK
    vmask = vv < DV
    row0 = tl.load(run_row0 + run).to(tl.int64)
    n = tl.load(run_len + run)
    fresh = tl.load(run_start + run) == 0
    slot = tl.load(run_slot + run).to(tl.int64)
    s_ptrs = state_ptr + ((slot * HEADS + h) * DK + kk[:, None]) * DV + vv[None, :]
    smask = kmask[:, None] & vmask[None, :]
    state = tl.load(s_ptrs, mask=smask & ~fresh, other=0.0)  # [BK, BV] fp32
    rate = tl.exp(tl.load(a_log_ptr + h))
    dt = tl.load(dt_bias_ptr + h * DK + kk, mask=kmask, other=0.0)
    dt_ty = out_ptr.dtype.element_ty
    for t in range(n):
        r = row0 + t
        col = r * (HEADS * DK) + h * DK
        q = tl.load(q_ptr + col + kk, mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + col + kk, mask=kmask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + r * (HEADS * DV) + h * DV + vv, mask=vmask, other=0.0).to(tl.float32)
        g = tl.load(pre_ptr + r * stride_pre + h * DK + kk, mask=kmask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + r * stride_b + h).to(tl.float32)
        beta = (1.0 / (1.0 + tl.exp(-b))).to(dt_ty).to(tl.float32)  # rounded as the reference
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        g = g + dt
        if LOWER:
            g = lower_bound * (1.0 / (1.0 + tl.exp(-(rate * g))))
        else:
            g = -rate * tl.where(g > 20.0, g, tl.log(1.0 + tl.exp(g)))
        state = state * tl.exp(g)[:, None]
        delta = (v - tl.sum(state * k[:, None], axis=0)) * beta  # [BV]
        state = state + k[:, None] * delta[None, :]
        o = tl.sum(state * q[:, None], axis=0)
        tl.store(out_ptr + r * (HEADS * DV) + h * DV + vv, o.to(dt_ty), mask=vmask)
        if TAPS:  # the state after the run's first t + 1 rows, but the last's (the slot's)
            tap = taps_ptr + run.to(tl.int64) * stride_tap_run + t * (HEADS * DK * DV)
            tap_mask = smask & (t < n - 1)
            tl.store(tap + (h * DK + kk[:, None]) * DV + vv[None, :], state, mask=tap_mask)
    tl.store(s_ptrs, state, mask=smask)


def recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pre: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    states: torch.Tensor,
    run_row0: torch.Tensor,
    run_len: torch.Tensor,
    run_start: torch.Tensor,
    run_slot: torch.Tensor,
    out: torch.Tensor,
    taps: torch.Tensor | None = None,
) -> None:
    """The gated delta rule over runs of rows (kda.delta_rule with its inputs made as the
    reference makes them: q, k l2-normed, q scaled by K^-0.5, the forget gate from pre, beta the
    sigmoid of b rounded to the model dtype), each run's state read from and left in its slot.

    q, k [N, heads·K], v [N, heads·V] contiguous (the conv's output); pre [N, heads·K] (the
    forget gate before its activation) and b [N, heads] (beta before its sigmoid), rows strided;
    a_log [heads], dt_bias [heads·K] fp32; states [slots, heads, K, V] fp32; run_* [m] int32: a
    run's first row, its rows, its first row's position (0: a fresh state, zeros) and its slot;
    out [N, heads, V] (model dtype), written at the runs' rows. taps: None, or [m, T, heads, K,
    V] fp32 contiguous: row a - 1 of run j's gets its state after its first a rows, for each a
    below the run's length (T at least the longest run's rows - 1): a verify pass's taps at
    every draft row, in the same launch (the bits the slot holds after a run of a rows)."""
    m, heads = run_row0.shape[0], states.shape[1]
    dk, dv = states.shape[2], states.shape[3]
    if m == 0:
        return
    if pre.stride(1) != 1:
        pre = pre.contiguous()
    if b.stride(1) != 1:
        b = b.contiguous()
    if taps is not None:
        assert taps.dtype == torch.float32 and taps.is_contiguous() and taps.shape[0] == m
    _recurrent_kernel[(m, heads, cdiv(dv, VALUE_BLOCK))](
        q,
        k,
        v,
        pre,
        b,
        a_log,
        dt_bias,
        states,
        out,
        run_row0,
        run_len,
        run_start,
        run_slot,
        states if taps is None else taps,  # unread without taps
        -1.0 if lower_bound is None else float(lower_bound),
        dk**-0.5,
        pre.stride(0),
        b.stride(0),
        0 if taps is None else taps.stride(0),
        HEADS=heads,
        DK=dk,
        DV=dv,
        BK=next_power_of_2(dk),
        BV=VALUE_BLOCK,
        LOWER=lower_bound is not None,
        TAPS=taps is not None,
        num_warps=RECURRENT_WARPS,
        **launch_options(states),
    )
