"""Prompt-lookup (n-gram) drafts: the next tokens a stream's own history suggests.

A stream's history is its prompt and the tokens generated so far. Its last n tokens (the
suffix) are looked up earlier in the history, n from `max_n` down to `min_n`; at the longest n
that occurs earlier with at least one token after it, the most recent such occurrence wins, and
the up to k tokens that followed it there are the draft. No match at `min_n` or longer: no draft.
This is vLLM's `[ngram]` speculative method (`prompt_lookup_max` / `prompt_lookup_min`) and
llama.cpp's prompt lookup (its n-gram sizes 1..4 are the defaults here), without weights, so it
serves every family; it pays where the answer repeats its input (code edits, quotes,
extraction, a list's pattern).

A draft only proposes: the verify pass samples every position as plain decoding would and keeps
the drafts while they agree (issue 57), so what is proposed never changes a token, only how many
a pass yields. Hence this module is pure and deterministic, with two ways to the same answer:

- `propose_ngram(history, k)` scans the history backwards once: O(len(history) * max_n).
- `NgramDrafter` keeps, for each n, the most recent end of every n-gram that has a token after
  it, updated as tokens are appended (`extend`, O(max_n) a token), so `propose(k)` costs
  O(max_n + k) whatever the history's length: the form the lanes call once a round.

Both give the same draft for the same history (tests/test_ngram_drafts.py), and a draft is
always a run of tokens that occurs in the history right after an occurrence of the suffix it
matched. A draft stops at the end of the history: a periodic tail whose match ends near the end
proposes fewer than k (never tokens the history does not show after the match).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

MAX_N = 4  # the longest suffix looked up (llama.cpp's lookup: 4)
MIN_N = 1  # the shortest (llama.cpp's lookup: 1); a longer one drafts less often, more surely


def _check(k: int, max_n: int, min_n: int) -> None:
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if not 1 <= min_n <= max_n:
        raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}..{max_n}")


def propose_ngram(
    history: Sequence[int], k: int, max_n: int = MAX_N, min_n: int = MIN_N
) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the history's longest
    matching suffix (n in max_n..min_n); [] when the last min_n tokens occur nowhere earlier
    with a token after them, or k is 0.

    One backward scan: for each end e < len(history) of a candidate occurrence (its tokens
    [e - n, e), the draft from e), the length of the common suffix of history[:e] and the
    history, capped at max_n; the first (most recent) e with the longest length wins."""
    _check(k, max_n, min_n)
    size = len(history)
    if k == 0 or size < min_n + 1:
        return []
    best_n, best_e = 0, -1
    for e in range(size - 1, min_n - 1, -1):
        n = 0
        limit = min(max_n, e)
        while n < limit and history[e - 1 - n] == history[size - 1 - n]:
            n += 1
        if n > best_n:  # strictly longer: among equals the most recent (seen first) stays
            best_n, best_e = n, e
            if n == max_n:
                break
    if best_n < min_n:
        return []
    return list(history[best_e : best_e + k])


class NgramDrafter:
    """A stream's history with an index of its n-grams: `extend` as tokens are accepted,
    `propose(k)` each round. Gives what `propose_ngram(self.history, k, max_n, min_n)` gives.

    `ends[n - min_n]` maps an n-gram (a tuple) to the most recent e such that history[e - n:e]
    is that n-gram and a token follows it (e < len(history)): an n-gram is indexed when the
    token after it is appended, so the history's own suffix is never its own match."""

    def __init__(self, history: Iterable[int] = (), max_n: int = MAX_N, min_n: int = MIN_N) -> None:
        _check(0, max_n, min_n)
        self.max_n = max_n
        self.min_n = min_n
        self.history: list[int] = []
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        self.extend(history)

    def __len__(self) -> int:
        return len(self.history)

    def append(self, token: int) -> None:
        """One more token of the history (a prompt's, or an accepted output token)."""
        h, e = self.history, len(self.history)
        for n in range(self.min_n, min(self.max_n, e) + 1):
            self.ends[n - self.min_n][tuple(h[e - n :])] = e
        h.append(token)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to k draft tokens for the next positions; [] when nothing matches."""
        _check(k, self.max_n, self.min_n)
        h = self.history
        if k == 0:
            return []
        for n in range(min(self.max_n, len(h)), self.min_n - 1, -1):
            e = self.ends[n - self.min_n].get(tuple(h[len(h) - n :]))
            if e is not None:
                return h[e : e + k]
        return []
