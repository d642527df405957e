"""The KDA delta rule of a pass on the kernels path: which rows go through fla-core's chunked
kernel and which through the recurrent one, and the launches.

fla-core's `chunk_kda` computes a 64-row chunk at once. Its bits for a row depend on the
chunk's rows and the state before the chunk, not on how long the launch is (measured on the
H200: a sequence cut at a chunk boundary into two launches equals one launch), but they differ
from the recurrent kernel's, and they change when sequences are packed into one varlen launch.
The recurrent kernel's per-token arithmetic is the same in every launch, packed or not.

So the kernel of a row is fixed by its absolute position and its stream's run in the pass:
- the whole chunks [64j, 64j + 64) inside a run go through `chunk_kda`, one launch per stream
  and per stretch between its taps (glm5_next's marks are chunk boundaries);
- the rows before the run's first chunk boundary (a decode row, a draft's rows) and after its
  last (a prompt's end) go through the recurrent kernel, all streams' runs in one launch, or,
  where a stream taps inside them (a verify run taps every draft row), in launches cut at its
  taps (`tap_cuts`), its state tapped after each. (A uniform verify pass, every stream a run
  of fewer than 64 rows tapped at each draft row, skips this plan: all its rows are recurrent,
  one launch writing each row's state, kda._verify_rule.)
The lanes cut a prompt only at multiples of the family's mark_rows (64 here), and a resume starts
at a mark, so a prompt's rows meet the same kernels alone or batched, in one pass or cut into
several, fresh or resumed; decode rows are always recurrent.

The recurrent kernel is `triton_kda.recurrent` (a run's rows in place, on either device), or with
`switches.OWN_RECURRENT` off fla-core's `fused_recurrent_kda` on packed copies of the rows.
The chunks: `FlaKernels` on the GPU; `TorchKernels` on the CPU under the interpreter, where
fla-core is absent: the token-by-token delta rule in fp64 (rounded back), so the chunked rows'
bits differ from the recurrent ones' as fla-core's do, and the CPU tests check this plan (its
fp32 form is the packed stand-in with OWN_RECURRENT off, and the recurrent kernel's reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

from tensorfold.family.forward_pass import ForwardPass
from tensorfold.ops import switches

from .layout import KDA_CHUNK as CHUNK

if TYPE_CHECKING:
    from .config import GlmConfig
    from .weights import KdaWeights


@dataclass(frozen=True)
class Segments:
    """A run's rows as offsets into the run: `head` and `tail` recurrent, `chunks` chunked."""

    head: tuple[int, int]
    chunks: tuple[tuple[int, int], ...]
    tail: tuple[int, int]


def segments(start: int, n: int, taps: Sequence[int] = ()) -> Segments:
    """The run of `n` rows from absolute position `start`: the rows up to the first chunk
    boundary, the whole chunks (cut at the taps between them), the rows past the last boundary."""
    a = min(n, -start % CHUNK)
    b = max(a, (start + n) // CHUNK * CHUNK - start)
    cuts = [a, *sorted({t - start for t in taps if a < t - start < b}), b]
    return Segments((0, a), tuple(zip(cuts, cuts[1:])) if b > a else (), (b, n))


def tap_cuts(rows: tuple[int, int], start: int, taps: Sequence[int] = ()) -> list[tuple[int, int]]:
    """Recurrent rows [a, e) of a run from absolute position `start`, cut at the taps inside
    them: the pieces in order (none when a == e). The recurrent kernel's per-row arithmetic is
    the same in every launch, so the cuts change no bits; each piece's end state is a tap's."""
    a, e = rows
    if e <= a:
        return []
    bounds = [a, *sorted({t - start for t in taps if a < t - start < e}), e]
    return list(zip(bounds, bounds[1:]))


class Kernels(Protocol):
    """q, k, v, pre [R, D] (pre: the forget gate's input); beta [R, heads]. -> (o [R, heads, V]
    in q's dtype, the states after)."""

    cfg: "GlmConfig"
    w: "KdaWeights"

    def packed(
        self, q, k, v, pre, beta, states: torch.Tensor, cu: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed runs (cu: the cumulative lengths [m + 1]), states [m, heads, K, V]: the
        recurrent rows when switches.OWN_RECURRENT is off."""

    def chunked(self, q, k, v, pre, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One stream's whole chunks, state [1, heads, K, V]."""


def delta_rule_pass(
    kernels: Kernels,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pre: torch.Tensor,
    b: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    fp: ForwardPass,
    name: str,
) -> torch.Tensor:
    """The delta rule over a pass. b: beta before its sigmoid (the recurrent kernel's), beta
    after it (the chunks'); states [slots, heads, K, V] fp32, fresh streams' already zeroed;
    read and left in place, tapped at the streams' taps. -> o [N, heads, V]."""
    from . import triton_kda

    n, heads, dv = q.shape[0], states.shape[1], states.shape[-1]
    out = torch.empty(n, heads, dv, dtype=q.dtype, device=q.device)
    plans = [segments(s.start, hi - lo, s.taps) for s, (lo, hi) in zip(fp.streams, fp.spans)]

    def tap(i: int, end: int, state: torch.Tensor) -> None:
        stream = fp.streams[i]
        if stream.start + end in stream.taps:
            fp.tap(i, stream.start + end, name, state.clone())

    def recurrent(part: str) -> None:
        """The streams' `part` rows, cut at their taps (tap_cuts): launch j holds the j-th piece
        of every stream that has one, so a stream without taps inside its rows is in the first
        launch only, and each tap is a launch's end."""
        pieces = [
            (i, tap_cuts(getattr(p, part), fp.streams[i].start, fp.streams[i].taps))
            for i, p in enumerate(plans)
        ]
        for j in range(max(len(cut) for _, cut in pieces)):
            launch([(i, fp.spans[i][0], cut[j]) for i, cut in pieces if j < len(cut)])

    def launch(runs: list[tuple[int, int, tuple[int, int]]]) -> None:
        if not runs:
            return
        if switches.OWN_RECURRENT.on():  # in place, the rows where they are
            table = torch.tensor(
                [
                    [lo + a for _, lo, (a, _) in runs],
                    [e - a for _, _, (a, e) in runs],
                    [fp.streams[i].start + a for i, _, (a, _) in runs],
                    [fp.streams[i].slot for i, _, _ in runs],
                ],
                dtype=torch.int32,
            ).to(q.device)
            triton_kda.recurrent(
                q,
                k,
                v,
                pre,
                b,
                kernels.w.a_log,
                kernels.w.dt_bias,
                kernels.cfg.linear_lower_bound,
                states,
                *table,
                out,
            )
            for i, _, (_, e) in runs:
                tap(i, e, states[fp.streams[i].slot])
            return
        rows = torch.cat([torch.arange(lo + a, lo + e) for _, lo, (a, e) in runs]).to(q.device)
        slots = torch.tensor([fp.streams[i].slot for i, _, _ in runs], device=q.device)
        cu = torch.tensor([0, *accumulate(e - a for _, _, (a, e) in runs)], device=q.device)
        pick = [t.index_select(0, rows) for t in (q, k, v, pre, beta)]
        o, final = kernels.packed(*pick, states.index_select(0, slots), cu)
        out.index_copy_(0, rows, o)
        states.index_copy_(0, slots, final)
        for j, (i, _, (_, e)) in enumerate(runs):
            tap(i, e, final[j])

    recurrent("head")
    for i, (plan, (lo, _)) in enumerate(zip(plans, fp.spans)):
        if not plan.chunks:
            continue
        slot = fp.streams[i].slot
        state = states[slot : slot + 1]
        for a, e in plan.chunks:
            o, state = kernels.chunked(*(t[lo + a : lo + e] for t in (q, k, v, pre, beta)), state)
            out[lo + a : lo + e] = o
            tap(i, e, state[0])
        states[slot] = state[0]
    recurrent("tail")
    return out


class FlaKernels:
    """fla-core 0.6.0's kernels, the forget gate and the q/k l2norm computed inside them."""

    def __init__(self, cfg: "GlmConfig", w: "KdaWeights", heads: int):
        self.cfg, self.w, self.heads, self.dk = cfg, w, heads, cfg.linear_head_dim
        self.common = dict(
            A_log=w.a_log,
            dt_bias=w.dt_bias,
            scale=self.dk**-0.5,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            lower_bound=cfg.linear_lower_bound,
        )

    def _rows(self, q, k, v, pre, beta) -> dict[str, torch.Tensor]:
        r, h = q.shape[0], self.heads
        return dict(
            q=q.view(1, r, h, -1),
            k=k.view(1, r, h, -1),
            v=v.view(1, r, h, -1),
            g=pre.view(1, r, h, -1),
            beta=beta.view(1, r, h),
        )

    def packed(self, q, k, v, pre, beta, states, cu):
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        out = torch.empty(1, q.shape[0], self.heads, self.dk, dtype=q.dtype, device=q.device)
        _, final = fused_recurrent_kda_fwd(
            **self._rows(q, k, v, pre, beta),
            initial_state=states,
            output_final_state=True,
            inplace_final_state=False,
            cu_seqlens=cu.long(),
            out=out,
            **self.common,
        )
        return out[0], final

    def chunked(self, q, k, v, pre, beta, state):
        from fla.ops.kda import chunk_kda

        o, final = chunk_kda(
            **self._rows(q, k, v, pre, beta),
            initial_state=state,
            output_final_state=True,
            **self.common,
        )
        return o[0], final


class TorchKernels:
    """The CPU stand-in (see the module's docstring): `kda.delta_rule`, token by token."""

    def __init__(self, cfg: "GlmConfig", w: "KdaWeights", heads: int):
        self.cfg, self.w, self.heads, self.dk = cfg, w, heads, cfg.linear_head_dim

    def _rule(self, q, k, v, pre, beta, state, dtype):
        from .kda import delta_rule, l2norm, log_decay

        r, h, dk = q.shape[0], self.heads, self.dk
        qs, ks, vs = (t.float().view(r, h, dk) for t in (q, k, v))
        o, final, _ = delta_rule(
            (l2norm(qs) * dk**-0.5).to(dtype),
            l2norm(ks).to(dtype),
            vs.to(dtype),
            log_decay(self.cfg, self.w, pre).to(dtype),
            beta.float().to(dtype),
            state.to(dtype),
        )
        return o.to(q.dtype), final.float()

    def packed(self, q, k, v, pre, beta, states, cu):
        bounds = cu.tolist()
        parts = [
            self._rule(*(t[a:b] for t in (q, k, v, pre, beta)), states[j], torch.float32)
            for j, (a, b) in enumerate(zip(bounds, bounds[1:]))
        ]
        return torch.cat([o for o, _ in parts]), torch.stack([s for _, s in parts])

    def chunked(self, q, k, v, pre, beta, state):
        o, final = self._rule(q, k, v, pre, beta, state[0], torch.float64)
        return o, final[None]
