"""A stream's drafts: where they come from, how many a round, and what came of them.

A verify round feeds a stream's next token and its k drafts as k + 1 rows of one pass and
samples every row as plain decoding would (`tensorfold.engine.lanes`), so a draft never changes
a token, only how many one pass yields. This module decides the drafts:

- sources, tried in order: the request's prediction (OpenAI's Predicted Outputs,
  `PredictionDrafter`), then the server's: with `--draft model` the family's draft model, with
  `--draft mtp` the checkpoint's own multi-token-prediction layer (each a
  `tensorfold.family.drafter.ModelDrafter`, asked by the lanes once a round), with `--draft
  ngram` prompt lookup over the stream's own prompt and output (`ngram_drafts.NgramDrafter`);
- k, per stream (`DraftPolicy`): drafting pays while the expected tokens a round,
  1 + a + a^2 + .. + a^k for a draft's acceptance a, outgrow what the verify pass costs against
  a plain one (`DraftSettings.verify_cost`: measured by the warm-up for each row count a graph
  replays, else `pass_cost` plus `row_cost` a draft row). The acceptance is a running estimate
  of the chance a draft is kept once those before it were (a round's kept drafts over the
  drafts it judged: the kept ones and the first refused); a stream whose drafts stop paying
  drafts nothing for a while, then tries one draft again (after 8 rounds, doubling to 256
  while it keeps failing). The lanes cap k further: at max_tokens, and per pass as the batch
  grows (`Lanes._paying`: a padded pass must yield more than its streams' plain rounds would).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from .ngram_drafts import NgramDrafter

DraftSource = Literal["off", "ngram", "model", "mtp"]
DRAFT_SOURCES: tuple[str, ...] = ("off", "ngram", "model", "mtp")
# the sources whose drafts a ModelDrafter proposes (the model_drafter hook's answer)
MODEL_SOURCES: tuple[str, ...] = ("model", "mtp")
MAX_DRAFT_TOKENS = 16  # k + 1 rows stay well inside glm5_next's 64-row KDA chunk


@dataclass(frozen=True)
class DraftSettings:
    """source: drafts besides a request's prediction; tokens: the most drafts a round (k);
    adaptive: the per-stream policy on (off: k whenever a source proposes, for tests);
    row_cost: a draft row's cost relative to a one-row pass, the policy's price;
    pass_rows: decode rows (plain and draft) a pass may hold before drafts are cut (row_cost
    is a first guess, used only where no verify_costs were measured; pass_rows too, though
    docs/performance.md "Drafting" measures the batch sizes around it);
    pass_cost: a verify pass's cost before its rows, over a plain decode pass's (1 where both
    run alike; on a GPU whose decode rounds replay CUDA graphs and whose verify passes run
    eagerly, the ratio the warm-up measured: drafts must pay for it); verify_costs: (rows a
    stream, cost over a plain decode round) of the verify passes a graph replays, as the
    warm-up measured them (GraphRunner.pass_prices), rows ascending; they override the two
    before."""

    source: DraftSource = "off"
    tokens: int = 4
    adaptive: bool = True
    row_cost: float = 0.1
    pass_rows: int = 64
    pass_cost: float = 1.0
    verify_costs: tuple[tuple[int, float], ...] = ()

    def verify_cost(self, rows: int) -> float:
        """A verify pass of `rows` rows a stream over a plain decode round: the measured cost of
        the smallest row count at or above it in `verify_costs` ((rows, cost) pairs the warm-up
        measured, rows ascending: the lanes pad a pass to such a count), else pass_cost plus
        row_cost a draft row."""
        for r, cost in self.verify_costs:
            if r >= rows:
                return cost
        return self.pass_cost + self.row_cost * (rows - 1)

    def __post_init__(self) -> None:
        if self.source not in DRAFT_SOURCES:
            raise ValueError(f"draft source {self.source!r}: one of {', '.join(DRAFT_SOURCES)}")
        if not 1 <= self.tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft tokens {self.tokens}: 1..{MAX_DRAFT_TOKENS}")


class PredictionDrafter:
    """Drafts from a given text's tokens (the request's `prediction`), kept in step with the
    output. While the output repeats the prediction, the drafts are the prediction's next
    tokens. After the output departs from it, the cursor re-syncs where the output's last
    tokens (4 down to 2) occur in the prediction, the first such place at or after the cursor
    (else anywhere); with no such place it keeps its position, as if a token was substituted."""

    RESYNC_MAX, RESYNC_MIN = 4, 2

    def __init__(self, prediction: Sequence[int]) -> None:
        self.prediction = list(prediction)
        self.output: list[int] = []
        self.cursor = 0  # where the next output token is expected in the prediction
        self.drafted: set[int] = set()  # the prediction's positions ever proposed

    def append(self, token: int) -> None:
        self.output.append(token)
        self.cursor += 1

    def _aligned(self) -> bool:
        c = self.cursor
        return not self.output or (
            0 < c <= len(self.prediction) and self.prediction[c - 1] == self.output[-1]
        )

    def _resync(self) -> None:
        p, out = self.prediction, self.output
        for n in range(min(self.RESYNC_MAX, len(out)), self.RESYNC_MIN - 1, -1):
            tail = out[-n:]
            ends = [e for e in range(n, len(p) + 1) if p[e - n : e] == tail]
            if ends:
                later = [e for e in ends if e >= self.cursor]
                self.cursor = later[0] if later else ends[0]
                return

    def propose(self, k: int) -> list[int]:
        if not self._aligned():
            self._resync()
        drafts = self.prediction[self.cursor : self.cursor + k]
        self.drafted.update(range(self.cursor, self.cursor + len(drafts)))
        return drafts


class DraftPolicy:
    """How many drafts a stream proposes next round, from its recent acceptance."""

    PRIOR = 0.6  # acceptance assumed before any round
    KEEP = 0.7  # the running estimate's weight on the past
    PAUSE, MAX_PAUSE = 8, 256

    def __init__(self, settings: DraftSettings) -> None:
        self.settings = settings
        self.acceptance = self.PRIOR
        self.pause_left = 0
        self.pause = self.PAUSE

    def k(self) -> int:
        s = self.settings
        if not s.adaptive:
            return s.tokens
        if self.pause_left > 0:
            self.pause_left -= 1
            return 1 if self.pause_left == 0 else 0  # a pause ends with one probing draft
        return self.best_k()

    def best_k(self) -> int:
        """The k whose expected tokens over its pass's cost beat a plain pass most; 0: none."""
        s = self.settings
        best, best_k = 1.0, 0
        for k in range(1, s.tokens + 1):
            gain = self.expected(k) / s.verify_cost(k + 1)
            if gain > best:
                best, best_k = gain, k
        return best_k

    def expected(self, k: int) -> float:
        """Tokens a round of k drafts is expected to yield: 1 + a + .. + a^k."""
        return sum(self.acceptance**i for i in range(k + 1))

    def wants(self) -> bool:
        """Whether the next round may draft (without counting a round of a pause down)."""
        if not self.settings.adaptive:
            return True
        if self.pause_left > 0:
            return self.pause_left == 1
        return self.best_k() > 0

    def settle(self, proposed: int, accepted: int) -> None:
        """A round's outcome: `accepted` of `proposed` drafts kept."""
        if not self.settings.adaptive or proposed == 0:
            return
        judged = accepted + (accepted < proposed)  # the kept ones and the first refused
        self.acceptance = self.KEEP * self.acceptance + (1 - self.KEEP) * accepted / judged
        if self.best_k() == 0:  # no k pays now: pause, then probe
            self.pause_left = self.pause
            self.pause = min(self.pause * 2, self.MAX_PAUSE)
        elif accepted:
            self.pause = self.PAUSE


class StreamDrafts:
    """One stream's draft sources, policy and counts. `propose` once a round, `append` each
    token the stream emits and `keep` each draft it kept (as it goes, so a stream that ends
    mid-round has counted what it kept), `settle` once the round's drafts are judged."""

    def __init__(
        self,
        settings: DraftSettings,
        prompt: Sequence[int],
        prediction: Sequence[int] = (),
    ) -> None:
        self.policy = DraftPolicy(settings)
        self.prediction = PredictionDrafter(prediction) if prediction else None
        self.ngram = NgramDrafter(prompt) if settings.source == "ngram" else None
        self.model = settings.source in MODEL_SOURCES  # the lanes set model_drafts each round
        self.model_drafts: list[int] = []
        self.from_prediction = False
        self.round = self.round_kept = 0  # this round's drafts, and how many were kept
        self.drafted = 0  # draft tokens fed to verify rounds
        self.accepted = 0  # of them, kept
        self.prediction_accepted = 0  # the prediction's tokens kept as drafts

    def propose(self, cap: int, valid: Callable[[list[int]], list[int]] | None = None) -> list[int]:
        """Up to min(policy's k, cap) drafts for the next round, cut by `valid` (a grammar's
        RowMatcher.valid_drafts); [] for none."""
        k = min(self.policy.k(), cap)
        if k <= 0:
            return []
        drafts = self.prediction.propose(k) if self.prediction else []
        self.from_prediction = bool(drafts)
        if not drafts and self.model:
            drafts = self.model_drafts[:k]
        if not drafts and self.ngram is not None:
            drafts = self.ngram.propose(k)
        if valid is not None:
            drafts = valid(drafts)
        self.round, self.round_kept = len(drafts), 0
        self.drafted += len(drafts)
        return drafts

    def keep(self) -> None:
        """This round's next draft was kept."""
        self.round_kept += 1
        self.accepted += 1
        self.prediction_accepted += self.from_prediction

    def wants(self) -> bool:
        """Whether the next round may draft: a stream that will not is sent ahead as plain."""
        return self.policy.wants()

    def append(self, token: int) -> None:
        if self.prediction is not None:
            self.prediction.append(token)
        if self.ngram is not None:
            self.ngram.append(token)

    def settle(self) -> None:
        self.policy.settle(self.round, self.round_kept)

    @property
    def prediction_rejected(self) -> int:
        """The prediction's tokens proposed (each position once) and not kept: as OpenAI's
        rejected_prediction_tokens, what of the prediction did not make it into the output."""
        if self.prediction is None:
            return 0
        return max(len(self.prediction.drafted) - self.prediction_accepted, 0)
