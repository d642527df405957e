"""Depthwise causal short convolution over one stream's run, with a carried tail (torch
reference, the CPU path).

A stream's conv state is its tail: the last K-1 inputs before the run, [C, K-1] (oldest first).
Output t of the run is Σ_j w[:, j] · ext[t + j] over ext = tail ++ run (K taps, accumulated in
fp32 in tap order, bias last, rounded to the input dtype). Every output is an elementwise function
of its own K inputs, so where a pass cuts the run cannot change it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from ..family.forward_pass import ForwardPass, StackedTaps
from .gpu import use_triton

if TYPE_CHECKING:
    from .pass_meta import PassMeta


def _extend(u: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """u [n, C], tail [C, K-1] -> ext [K-1+n, C]"""
    return torch.cat((tail.t().to(u.dtype), u), dim=0)


def causal_conv(
    u: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """u [n, C] (the run, in position order); tail [C, K-1]; weight [C, K]; bias [C].

    Returns (out [n, C] in u's dtype, new tail [C, K-1]: the last K-1 inputs of tail ++ run)."""
    n = u.shape[0]
    k = weight.shape[1]
    ext = _extend(u, tail)
    w = weight.float()
    acc = ext[0:n].float() * w[:, 0]
    for j in range(1, k):
        acc = acc + ext[j : j + n].float() * w[:, j]
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(u.dtype), ext[n:].t().contiguous()


def tails_at(u: torch.Tensor, tail: torch.Tensor, counts: Sequence[int], k: int) -> torch.Tensor:
    """The tail as it stood after the first `a` rows of the run, for each a in counts
    (1 <= a <= n). u [n, C]; tail [C, K-1] -> [len(counts), C, K-1]."""
    ext = _extend(u, tail)
    if any(not 0 <= a <= u.shape[0] for a in counts):
        raise ValueError(f"tap counts {list(counts)} must lie in [0, {u.shape[0]}]")
    taps = [ext[a : a + k - 1].t() for a in counts]
    if not taps:
        return ext.new_empty(0, ext.shape[1], k - 1)
    return torch.stack(taps)


def tails_each_row(u: torch.Tensor, state: torch.Tensor, meta: "PassMeta", r: int) -> torch.Tensor:
    """A uniform verify pass's conv tails after each stream's rows 1..R-1 (ForwardPass.rows_each
    = r), from the device meta alone, so a CUDA graph replays it: u [S*R, C] the conv's inputs;
    state [slots, C, K-1] the tails before the pass (a fresh stream's read as zeros) ->
    [S, R-1, C, K-1] in u's dtype, as tails_at takes them."""
    tails = state.index_select(0, meta.stream_slot.long())  # [S, C, K-1]
    tails = torch.where((meta.stream_start == 0)[:, None, None], torch.zeros_like(tails), tails)
    k1 = tails.shape[-1]
    ext = torch.cat((tails.transpose(1, 2).to(u.dtype), u.view(-1, r, u.shape[-1])), dim=1)
    return ext.unfold(1, k1, 1)[:, 1:r].contiguous()  # window j: the K-1 inputs before row j


def gated_conv(
    bcx: torch.Tensor,
    state: torch.Tensor,
    fp: ForwardPass,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tap_name: str | None = None,
) -> torch.Tensor:
    """The gated short conv of a whole pass: C ⊙ conv(B ⊙ x), each stream carried in its slot.

    bcx [N, 3H]: the in-projection's rows, channels B, C, x in that order; state [slots, H, K-1]:
    tails, read (zeros for a stream starting at row 0) and left as they stand after each run;
    weight [H, K]; bias [H]. With tap_name, the tail at each of a stream's taps goes to
    fp.tap(i, p, tap_name, tail), or on the Triton path of a uniform verify pass (fp.rows_each)
    the tails after each row to fp.tap_rows. Returns [N, H] in bcx's dtype."""
    b, c, xs = bcx.chunk(3, dim=-1)  # 3 x [N, H]
    gpu = use_triton(bcx)
    if gpu and fp.rows_each and tap_name is not None:
        from .pass_meta import pass_meta

        tails = tails_each_row(b * xs, state, pass_meta(fp), fp.rows_each)
        fp.tap_rows(tap_name, StackedTaps(tails))
    u = None if gpu else b * xs
    z = None if gpu else torch.empty_like(b)
    for i, (stream, (lo, hi)) in enumerate(zip(fp.streams, fp.spans)):
        if gpu and (not stream.taps or fp.rows_each):
            continue  # the kernel alone: no taps, or a uniform pass's (taken above)
        tail = state[stream.slot]
        if stream.start == 0:
            tail = torch.zeros_like(tail)
        run = b[lo:hi] * xs[lo:hi] if u is None else u[lo:hi]
        if stream.taps and tap_name is not None:
            counts = [p - stream.start for p in stream.taps]
            for p, tapped in zip(stream.taps, tails_at(run, tail, counts, weight.shape[-1])):
                fp.tap(i, p, tap_name, tapped)
        if z is not None:
            z[lo:hi], state[stream.slot] = causal_conv(run, tail, weight, bias)
    if gpu:  # the taps above read the tails before the kernel moves them on
        from .pass_meta import pass_meta
        from .triton_conv import gated_conv as triton_gated_conv

        return triton_gated_conv(
            bcx,
            state,
            pass_meta(fp),
            weight,
            bias,
            one_row_each=all(hi - lo == 1 for lo, hi in fp.spans),
        )
    assert z is not None  # made on the CPU path
    return c * z
