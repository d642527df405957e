"""Seeded, batch-invariant sampling.

A row's token is a function of its own logits, params and history only. Its random draw for output
position t is a pure function of (seed, t): Philox-4x32-10 keyed by the seed, counting t. So a
stream samples the same tokens alone or batched, resumed or fresh. There is no global RNG state.

Per row, in this order: penalties on the raw logits (repetition, then frequency and presence, as
vLLM orders them) -> logit_bias (added to the row's own logits) -> temperature -> top_k -> top_p
-> min_p -> renormalise -> inverse-CDF draw over tokens sorted by probability descending, ties
to the lower id, the weights as integers in units of 2**-36 of the top token's (so the sums are
exact in any order: a row draws alike alone or in a batch of any size, on any device kernel).
top_k keeps exactly k tokens of that order (ties at the edge to the lower ids, unlike HF's
keep-all-ties), so top_k=1 is greedy. Temperature 0 is greedy: argmax of the penalised and
biased logits, ties to the lowest id.

Logprobs are log_softmax of the penalised and biased logits, before temperature and filtering:
what the row was drawn from before the sampler's filters. On the GPU a row's are (x - max) -
log Σ exp(x - max) with the sum in ops/triton_row_stats.py's order, whatever else the round holds.
"""

from __future__ import annotations

import math
import numbers
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Callable, NamedTuple

import torch

from ..ops.gpu import use_triton

_M32 = 0xFFFF_FFFF
_M64 = (1 << 64) - 1
MAX_STOPS = 16
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range: biases are clamped to [-100, 100]


def philox4x32(
    counter: Sequence[int], key: Sequence[int], rounds: int = 10
) -> tuple[int, int, int, int]:
    """Philox-4x32 (Salmon et al. 2011, Random123): four 32-bit counter words, two key words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0 = (k0 + 0x9E3779B9) & _M32
            k1 = (k1 + 0xBB67AE85) & _M32
        p0 = 0xD2511F53 * c0
        p1 = 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & _M32, (p0 >> 32) ^ c3 ^ k1, p0 & _M32
    return c0, c1, c2, c3


def uniform(seed: int, t: int) -> float:
    """The uniform in [0, 1), 53 bits, for output position t of a stream seeded with `seed`."""
    if not 0 <= t <= _M64:
        raise ValueError(f"output position t must be in 0..2**64-1, got {t}")
    s = seed & _M64
    w0, w1, _, _ = philox4x32((t & _M32, t >> 32, 0, 0), (s & _M32, s >> 32))
    return ((w0 >> 5) * (1 << 26) + (w1 >> 6)) / float(1 << 53)


class SamplingParamsError(ValueError):
    """A sampling parameter out of range; `field` names it (OpenAI's error `param`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field


def _real(name: str, value: object, ok: Callable[[float], bool], accepted: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(float(value))
        or not ok(float(value))
    ):
        raise SamplingParamsError(name, f"must be {accepted}, got {value!r}")
    return float(value)


def _int(name: str, value: object, ok: Callable[[int], bool], accepted: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not ok(int(value)):
        raise SamplingParamsError(name, f"must be {accepted}, got {value!r}")
    return int(value)


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise SamplingParamsError(name, f"must be true or false, got {value!r}")
    return value


_REAL_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "temperature": (lambda v: v >= 0, ">= 0 (0 = greedy)"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "repetition_penalty": (lambda v: v > 0, "> 0 (1 = off)"),
}
_SEED_RANGE = "an integer in -2**63..2**64-1"


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (ids as ints or decimal strings, as JSON sends them) -> sorted pairs,
    biases clamped to [-100, 100]. A tuple of pairs is taken as it is."""
    if isinstance(value, Mapping):
        items: Iterable[object] = value.items()
    elif isinstance(value, (tuple, list)):
        items = value
    else:
        raise SamplingParamsError(
            "logit_bias", f"must be an object of token id: bias, got {value!r}"
        )
    out: dict[int, float] = {}
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise SamplingParamsError("logit_bias", f"must map token ids to biases, got {item!r}")
        key, bias = item
        if isinstance(key, str) and key.isascii() and key.isdecimal():
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, numbers.Integral) or key < 0:
            raise SamplingParamsError(
                "logit_bias", f"keys must be token ids (integers >= 0), got {key!r}"
            )
        if (
            isinstance(bias, bool)
            or not isinstance(bias, numbers.Real)
            or not math.isfinite(float(bias))
        ):
            raise SamplingParamsError(
                "logit_bias",
                f"values must be finite numbers (clamped to -100..100), got "
                f"{bias!r} for token {key}",
            )
        out[int(key)] = min(max(float(bias), -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT)
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class SamplingParams:
    """How one stream samples; validated on construction (raises SamplingParamsError)."""

    temperature: float = 1.0  # >= 0; 0 = greedy
    top_k: int = 0  # 0 or -1 = off, else >= 1
    top_p: float = 1.0  # 0 < p <= 1
    min_p: float = 0.0  # 0 <= p <= 1
    presence_penalty: float = 0.0  # -2..2, over generated tokens
    frequency_penalty: float = 0.0  # -2..2, over generated tokens
    repetition_penalty: float = 1.0  # > 0, 1 = off; over prompt + generated tokens
    seed: int | None = None  # -2**63..2**64-1; None: with_seed() draws one
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # 0..20, needs logprobs
    keep_special_ids: tuple[int, ...] = ()  # special tokens written into the text (tool markers)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]), by id
    # structured output (tensorfold.engine.structured.Constraint): the lanes mask each row's logits
    # with its own matcher before the draw; None: free text
    constraint: Any = None

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        for name, (ok, accepted) in _REAL_RANGES.items():
            put(name, _real(name, getattr(self, name), ok, accepted))
        put("top_k", max(_int("top_k", self.top_k, lambda v: v >= -1, "0, -1 or >= 1"), 0))
        if self.seed is not None:
            put("seed", _int("seed", self.seed, lambda v: -(2**63) <= v < 2**64, _SEED_RANGE))
        put("max_tokens", _int("max_tokens", self.max_tokens, lambda v: v >= 1, ">= 1"))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        stop = tuple(stop) if isinstance(stop, Iterable) else (None,)
        if not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOPS:
            raise SamplingParamsError(
                "stop", f"must be at most {MAX_STOPS} non-empty strings, got {self.stop!r}"
            )
        put("stop", stop)
        ids = self.stop_token_ids if isinstance(self.stop_token_ids, Iterable) else [None]
        ids = tuple(_int("stop_token_ids", i, lambda v: v >= 0, "ids >= 0") for i in ids)
        put("stop_token_ids", ids)
        keep = self.keep_special_ids if isinstance(self.keep_special_ids, Iterable) else [None]
        put(
            "keep_special_ids",
            tuple(_int("keep_special_ids", i, lambda v: v >= 0, "ids >= 0") for i in keep),
        )
        for name in ("ignore_eos", "logprobs"):
            put(name, _bool(name, getattr(self, name)))
        top_n = _int("top_logprobs", self.top_logprobs, lambda v: 0 <= v <= 20, "in 0..20")
        if top_n and not self.logprobs:
            raise SamplingParamsError("top_logprobs", "needs logprobs set to true")
        put("top_logprobs", top_n)
        put("logit_bias", _logit_bias(self.logit_bias))
        if self.constraint is not None and not callable(getattr(self.constraint, "start", None)):
            raise SamplingParamsError(
                "constraint",
                "must be a tensorfold.engine.structured.Constraint (see "
                f"tensorfold.engine.structured.response_format), got {self.constraint!r}",
            )
        if self.constraint is not None and self.ignore_eos:
            raise SamplingParamsError(
                "ignore_eos",
                "cannot be combined with structured output: the grammar ends the "
                "reply with the end of text once it is complete",
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    def with_seed(self) -> SamplingParams:
        """This, or a copy with a seed from OS randomness if none was given (to be reported)."""
        return self if self.seed is not None else replace(self, seed=secrets.randbits(63))


class SampleResult(NamedTuple):
    token: int
    logprob: float  # of `token`, from the penalised logits before temperature and filtering
    top_logprobs: list[tuple[int, float]]  # (id, logprob), most likely first, when asked


class RowHistory:
    """A stream's prompt and generated ids, with counts kept incrementally for the penalties."""

    def __init__(self, prompt_ids: Iterable[int] = (), output_ids: Iterable[int] = ()) -> None:
        self.prompt_ids: list[int] = list(prompt_ids)
        self.output_ids: list[int] = []
        self.counts: dict[int, int] = {}  # generated id -> occurrences
        self._seen: torch.Tensor | None = None  # [V] bool: in prompt or output
        self._dense_counts: torch.Tensor | None = None  # [V] fp32 (exact up to 2**24)
        self._folded = 0  # output ids already in the dense tensors
        for token in output_ids:
            self.append(token)

    def append(self, token: int) -> None:
        self.output_ids.append(token)
        self.counts[token] = self.counts.get(token, 0) + 1

    def dense(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen [V] bool, counts [V] fp32), built once, then only new tokens are folded in."""
        if self._seen is None or self._seen.numel() != vocab or self._seen.device != device:
            self._seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self._dense_counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            if self.prompt_ids:
                self._seen[torch.tensor(self.prompt_ids, dtype=torch.long, device=device)] = True
            self._folded = 0
        assert self._dense_counts is not None
        if new := self.output_ids[self._folded :]:
            ids = torch.tensor(new, dtype=torch.long, device=device)
            ones = torch.ones(len(new), dtype=torch.float32, device=device)
            self._dense_counts.index_put_((ids,), ones, accumulate=True)
            self._seen[ids] = True
            self._folded = len(self.output_ids)
        return self._seen, self._dense_counts

    def with_draft(self, tokens: Sequence[int]) -> "DraftedHistory":
        """This history as it would stand after `tokens` were generated (a verify round's row
        after its drafts), leaving this one as it is."""
        return DraftedHistory(self, list(tokens))


class DraftedHistory(RowHistory):
    """A stream's history plus draft tokens not (yet) accepted: row j of a verify round is
    penalised over the prompt, the output and drafts d1..dj, as plain decoding would penalise it
    once those tokens were its output. Counts are small integers in fp32, so folding the drafts
    into a copy gives the bits plain's incremental fold gives."""

    def __init__(self, base: RowHistory, drafts: list[int]) -> None:
        self.base = base
        self.drafts = drafts
        self.prompt_ids = base.prompt_ids
        self.output_ids = base.output_ids + drafts
        self.counts = dict(base.counts)
        for token in drafts:
            self.counts[token] = self.counts.get(token, 0) + 1

    def append(self, token: int) -> None:
        raise TypeError("a drafted history is read only: append to the stream's own history")

    def dense(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        seen, counts = self.base.dense(vocab, device)
        if not self.drafts:
            return seen, counts
        ids = torch.tensor(self.drafts, dtype=torch.long, device=device)
        ones = torch.ones(len(self.drafts), dtype=torch.float32, device=device)
        counts = counts.clone().index_put_((ids,), ones, accumulate=True)
        seen = seen.clone()
        seen[ids] = True
        return seen, counts


def apply_penalties(x: torch.Tensor, params: SamplingParams, history: RowHistory) -> torch.Tensor:
    """x: [V] fp32 raw logits -> penalised logits (a new tensor when any penalty is on)."""
    if not params.has_penalties:
        return x
    seen, counts = history.dense(x.numel(), x.device)
    if params.repetition_penalty != 1:
        r = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if params.frequency_penalty or params.presence_penalty:
        present = (counts > 0).to(torch.float32)
        x = x - (params.frequency_penalty * counts + params.presence_penalty * present)
    return x


def apply_logit_bias(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """x: [V] fp32 logits -> the row's own biases added (a new tensor when there are any). Ids
    are unique, so the result does not depend on the order of the additions."""
    if not params.logit_bias:
        return x
    ids, biases = zip(*params.logit_bias)
    if ids[-1] >= x.numel():
        raise ValueError(
            f"logit_bias token id {ids[-1]} is outside the {x.numel()}-token vocabulary"
        )
    x = x.clone()
    index = torch.tensor(ids, dtype=torch.long, device=x.device)
    x[index] += torch.tensor(biases, dtype=torch.float32, device=x.device)
    return x


WEIGHT_BITS = 36  # the draw's weights: integers in units of 2**-36 of the top token's weight


def _draw_rows(
    x: torch.Tensor,
    order: torch.Tensor,
    rows: Sequence[tuple[SamplingParams, int]],
) -> torch.Tensor:
    """x: [B, V] penalised logits, order: [B, V] ids by x descending (ties to lower id); rows:
    (params, t) of rows that sample (temperature > 0). Returns the drawn ids [B].

    Weights in draw order are w = exp((z - z_max) / temperature) in float64, each turned into an
    integer floor(w * 2**WEIGHT_BITS) (the top token's is 2**WEIGHT_BITS; a token under 2**-36 of
    it weighs nothing). Integer prefix sums are exact whatever the kernel's order of additions, so
    a row's draw cannot depend on the other rows of a batch, nor on how the device scans."""
    v, dev = x.shape[1], x.device
    temp = torch.tensor([p.temperature for p, _ in rows], dtype=torch.float64, device=dev)
    z = x.gather(1, order).to(torch.float64) / temp[:, None]
    w = torch.exp(z - z[:, :1])  # w[:, 0] == 1
    rank = torch.arange(v, device=dev)
    top_k = torch.tensor([p.top_k or v for p, _ in rows], device=dev)
    keep = (w > 0) & (rank < top_k[:, None])
    weight = torch.where(keep, torch.floor(w * float(1 << WEIGHT_BITS)), 0.0).to(torch.int64)
    top_p = [p.top_p for p, _ in rows]
    if min(top_p) < 1:
        cdf = torch.cumsum(weight, 1)
        p = torch.tensor(top_p, dtype=torch.float64, device=dev)[:, None]
        # total < 2**53: integers and products exact enough to compare in float64
        nucleus = (cdf - weight).to(torch.float64) < p * cdf[:, -1:].to(torch.float64)
        keep &= nucleus | (p >= 1)
    min_p = [p.min_p for p, _ in rows]
    if max(min_p) > 0:
        keep &= w >= torch.tensor(min_p, dtype=torch.float64, device=dev)[:, None]
    weight = torch.where(keep, weight, 0)
    cdf = torch.cumsum(weight, 1)
    total = cdf[:, -1:]  # >= 2**WEIGHT_BITS: the top token is always kept
    draws = []
    for params, t in rows:
        assert params.seed is not None  # the caller refuses a draw without one
        draws.append(uniform(params.seed, t))
    u = torch.tensor(draws, dtype=torch.float64, device=dev)
    target = torch.minimum(
        torch.floor(u[:, None] * total.to(torch.float64)).to(torch.int64), total - 1
    )
    i = torch.searchsorted(cdf, target, right=True)  # the first id whose cdf passes the target
    return order.gather(1, i)[:, 0]


class PendingRows(NamedTuple):
    """Rows drawn on the device, their read-back under way (`launch_rows`); `read_rows` waits."""

    tokens: torch.Tensor  # [B] int64 on the logits' device: what a device-fed round takes
    host: torch.Tensor  # [B, 2 + 2 * top_n] float64: token, logprob, top ids, top logprobs
    done: Any  # a CUDA event recorded after the copy to `host`, or None
    top: list[int]  # each row's top_logprobs
    top_n: int


def launch_rows(
    logits: torch.Tensor, rows: Sequence[tuple[SamplingParams, int, RowHistory]]
) -> PendingRows:
    """logits: [B, V] (any float dtype, any device); rows[i] = (params, t, history) of row i,
    sampling output position t of its stream. Row i gets what it gets alone (B = 1): each step
    works on rows independently (penalties and biases row by row, log_softmax, argmax and sort
    within a row, integer prefix sums). The results' one copy to the host is queued behind the
    draws, before whatever the caller queues next; `read_rows` waits for it."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
    v = logits.shape[1]
    biased = [i for i, (p, _, _) in enumerate(rows) if p.has_penalties or p.logit_bias]
    drawn = [i for i, (p, _, _) in enumerate(rows) if not p.is_greedy]
    top_n = min(max(p.top_logprobs for p, _, _ in rows), v)
    # on the GPU, rows reduced by ops/triton_row_stats.py (each row's first maximum, max and log
    # of its sum of exponentials, one launch; docs/performance.md, "ROW_KERNEL")
    kernel = use_triton(logits)
    if kernel and not (biased or drawn or top_n):
        from ..ops.triton_row_stats import row_stats

        # greedy rows alone: their token and logprob in one launch (the same values as below,
        # each row's sum of exponentials in the kernel's order)
        tokens, both, _, _ = row_stats(logits.contiguous())
        return _pending(tokens, both, rows, 0)
    x = logits.to(torch.float32)
    if kernel:
        x = x.contiguous()  # the row kernel reads unit-stride rows
    if biased and x is logits:  # written below: the caller's logits stay as they are
        x = x.clone()
    for i in biased:
        params, _, history = rows[i]
        x[i] = apply_logit_bias(apply_penalties(x[i], params, history), params)
    tokens, logprobs_at = row_logprobs(x, kernel)
    order = None
    if drawn or top_n:
        order = torch.sort(x, dim=1, descending=True, stable=True).indices
    if drawn:
        for i in drawn:
            if rows[i][0].seed is None:
                raise ValueError(
                    "sampling with temperature > 0 needs a seed: use params.with_seed()"
                )
        at = torch.tensor(drawn, device=x.device)
        assert order is not None  # sorted above for the draws
        picked = _draw_rows(x[at], order[at], [rows[i][:2] for i in drawn])
        tokens = tokens.index_copy(0, at, picked)
    parts = [tokens[:, None].to(torch.float64), logprobs_at(tokens[:, None]).to(torch.float64)]
    if top_n:
        assert order is not None
        ids = order[:, :top_n]
        parts += [ids.to(torch.float64), logprobs_at(ids).to(torch.float64)]
    return _pending(tokens, torch.cat(parts, 1), rows, top_n)


def row_logprobs(
    x: torch.Tensor, kernel: bool
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """x: [B, V] fp32 logits -> each row's first maximum [B] (ties to the lowest id), and
    `logprobs_at(ids [B, k])`, those ids' logprobs [B, k]: with `kernel` (the GPU, contiguous
    rows) from the row kernel's max and log of its sum of exponentials (ops/triton_row_stats.py),
    else from torch's log_softmax. Either way each row's are its own, whatever the batch: the
    sampler's logprobs and a prompt's (engine/prompt_logprobs.py) are both taken here."""
    if kernel:
        from ..ops.triton_row_stats import row_stats

        tokens, _, top, log_sum = row_stats(x)  # as above: a row's logprobs as it gets alone

        def logprobs_at(ids: torch.Tensor) -> torch.Tensor:
            return (x.gather(1, ids) - top[:, None]) - log_sum[:, None]

        return tokens, logprobs_at
    logprobs = torch.log_softmax(x, dim=1)

    def logprobs_of(ids: torch.Tensor) -> torch.Tensor:
        return logprobs.gather(1, ids)

    return torch.argmax(x, dim=1), logprobs_of


def _pending(
    tokens: torch.Tensor,
    both: torch.Tensor,
    rows: Sequence[tuple[SamplingParams, int, RowHistory]],
    top_n: int,
) -> PendingRows:
    """both [B, 2 + 2 * top_n] float64 on the logits' device, queued for the host."""
    done = None
    if both.is_cuda:  # into pinned memory, not waited for here
        host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
        host.copy_(both, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
    else:
        host = both
    return PendingRows(tokens, host, done, [min(p.top_logprobs, top_n) for p, _, _ in rows], top_n)


def read_rows(pending: PendingRows) -> list[SampleResult]:
    """The host's results of `launch_rows`, once its copy is done (the one read back)."""
    if pending.done is not None:
        pending.done.synchronize()
    out = []
    n = pending.top_n
    for k, row in zip(pending.top, pending.host.tolist()):
        top = [(int(i), lp) for i, lp in zip(row[2 : 2 + k], row[2 + n : 2 + n + k])]
        out.append(SampleResult(int(row[0]), row[1], top))
    return out


def sample_rows(
    logits: torch.Tensor, rows: Sequence[tuple[SamplingParams, int, RowHistory]]
) -> list[SampleResult]:
    """`launch_rows`, then `read_rows`: each row's token, logprob and top logprobs."""
    return read_rows(launch_rows(logits, rows))


def sample_row(
    logits: torch.Tensor, params: SamplingParams, t: int, history: RowHistory
) -> SampleResult:
    """Sample output position t of one stream. logits: [V] (any float dtype, any device)."""
    if logits.dim() != 1:
        raise ValueError(f"sample_row takes logits of shape [V], got {tuple(logits.shape)}")
    return sample_rows(logits[None], [(params, t, history)])[0]
