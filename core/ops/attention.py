"""Causal attention over paged K/V for a pass (torch reference, the CPU path).

Exactness: keys are visited in tiles of KEY_TILE aligned to absolute positions, with an online
softmax, and queries in blocks of QUERY_BLOCK (zero-padded). A tile that a query cannot see is an
exact no-op for it, so a row's result depends only on its own position and its stream's rows, not
on where the pass cut the prompt or what else shares the pass. The products are summed by
torch's reductions, not a BLAS, so that holds on every CPU (see rows_dot).

fp8 rows (TF_KV_DTYPE=fp8) come with their scales [P*R, Hkv, 1]: a key's scale multiplies its
scores after the sum over D, a value's its probabilities before the sum over keys, as the
Triton kernel does (tensorfold.ops.kv_quant).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..family.forward_pass import ForwardPass
from .gpu import use_triton

KEY_TILE = 64
QUERY_BLOCK = 16


def paged_attention(
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    fp: ForwardPass,
    *,
    scale: float,
    window: int | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [N, Hq, D]; k_rows [P*R, Hkv, D] and v_rows [P*R, Hkv, Dv]: flat views of the paged
    buffers, already holding this pass's rows. window: a query at t sees keys t-window < j <= t.
    k_scales, v_scales [P*R, Hkv, 1]: the rows' scales when they are stored in fp8 (both or
    neither). Returns [N, Hq, Dv] in q's dtype, computed in fp32."""
    assert (k_scales is None) == (v_scales is None), "fp8 keys and values come together"
    if use_triton(q):
        from .pass_meta import pass_meta
        from .triton_attention import paged_attention as triton_attention

        return triton_attention(
            q,
            k_rows,
            v_rows,
            fp.positions,
            pass_meta(fp),
            fp.page_rows,
            scale=scale,
            window=window,
            k_scales=k_scales,
            v_scales=v_scales,
        )
    out = q.new_empty(q.shape[0], q.shape[1], v_rows.shape[-1])
    for i, (a, b) in enumerate(fp.spans):
        idx = fp.read_index(i)
        keys = k_rows.index_select(0, idx).float()
        values = v_rows.index_select(0, idx).float()
        scales = None
        if k_scales is not None:
            assert v_scales is not None  # both scales or neither
            scales = k_scales.index_select(0, idx)[..., 0], v_scales.index_select(0, idx)[..., 0]
        out[a:b] = _stream_attention(
            q[a:b].float(), keys, values, fp.positions[a:b], scale, window, scales
        )
    return out


def _stream_attention(q, keys, values, positions, scale, window, scales=None):
    """q [n, Hq, D] at `positions`; keys/values [end, Hkv, D*] for positions [0, end);
    scales: None, or the keys' and values' fp8 scales [end, Hkv]."""
    n, hq, d = q.shape
    end, hkv, dv = values.shape
    group = hq // hkv
    pad_keys = (-end) % KEY_TILE
    keys = F.pad(keys, (0, 0, 0, 0, 0, pad_keys)).transpose(0, 1)  # [Hkv, T*, D]
    values = F.pad(values, (0, 0, 0, 0, 0, pad_keys)).transpose(0, 1)  # [Hkv, T*, Dv]
    if scales is not None:  # [Hkv, T*] each
        scales = tuple(F.pad(s, (0, 0, 0, pad_keys)).transpose(0, 1) for s in scales)
    out = q.new_empty(n, hq, dv)
    for qa in range(0, n, QUERY_BLOCK):
        qb = q[qa : qa + QUERY_BLOCK]
        pos = positions[qa : qa + QUERY_BLOCK]
        m = qb.shape[0]
        if m < QUERY_BLOCK:  # padded queries repeat the last position; their rows are dropped
            qb = F.pad(qb, (0, 0, 0, 0, 0, QUERY_BLOCK - m))
            pos = torch.cat([pos, pos[-1:].expand(QUERY_BLOCK - m)])
        out[qa : qa + m] = _block(qb, pos, keys, values, group, scale, window, scales)[:m]
    return out


def rows_dot(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [H, M, D], k [H, T, D] -> [H, M, T]: each q·k summed over D by torch's reduction, whose
    order for one output depends only on D. A BLAS (bmm) may sum a row in another order by its
    place in the block, and differently on each CPU kernel (MKL's AVX2 path does)."""
    return (q[:, :, None, :] * k[:, None, :, :]).sum(-1)


def weighted_rows(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p [H, M, T], v [H, T, Dv] -> [H, M, Dv]: Σ_t p·v, in an order that depends only on T."""
    return (p[:, :, :, None] * v[:, None, :, :]).sum(-2)


def _block(qb, pos, keys, values, group, scale, window, scales):
    """One query block against the key tiles it can see."""
    hkv = keys.shape[0]
    bq = qb.shape[0]
    # [Bq, Hkv*G, D] -> [Hkv, G*Bq, D]: query head h reads KV head h // G.
    qh = qb.view(bq, hkv, group, -1).permute(1, 2, 0, 3).reshape(hkv, group * bq, -1)
    qpos = pos.repeat(group)  # [G*Bq], matching qh's rows
    lo = 0 if window is None else max(0, int(pos.min()) - window + 1) // KEY_TILE * KEY_TILE
    hi = int(pos.max()) + 1
    dev = qb.device
    run_max = torch.full((hkv, group * bq, 1), float("-inf"), device=dev)
    run_sum = torch.zeros(hkv, group * bq, 1, device=dev)
    acc = torch.zeros(hkv, group * bq, values.shape[-1], device=dev)
    for t0 in range(lo, hi, KEY_TILE):
        kpos = torch.arange(t0, t0 + KEY_TILE, device=dev)
        visible = kpos[None, :] <= qpos[:, None]
        if window is not None:
            visible &= kpos[None, :] > qpos[:, None] - window
        s = rows_dot(qh, keys[:, t0 : t0 + KEY_TILE])
        if scales is not None:
            s = s * scales[0][:, None, t0 : t0 + KEY_TILE]
        s = (s * scale).masked_fill(~visible, float("-inf"))
        new_max = torch.maximum(run_max, s.amax(-1, keepdim=True))
        safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        p = torch.exp(s - safe)
        alpha = torch.exp(run_max - safe)
        run_sum = run_sum * alpha + p.sum(-1, keepdim=True)
        pv = p if scales is None else p * scales[1][:, None, t0 : t0 + KEY_TILE]
        acc = acc * alpha + weighted_rows(pv, values[:, t0 : t0 + KEY_TILE])
        run_max = new_max
    o = acc / run_sum  # [Hkv, G*Bq, Dv]
    return o.view(hkv, group, bq, -1).permute(2, 0, 1, 3).reshape(bq, hkv * group, -1)
