"""The lane scheduler: admission, passes, decode rounds.

Each round is one pass: every decoding lane's next row, then prompt rows in admission order up
to `pass_rows` (prompts not yet started before fills under way), each chunk cut on the absolute
`pass_rows` grid. A chunk that the row budget ends early is cut down to a multiple of the
family's `mark_rows` (where its state is exact; glm5_next's KDA chunks), so where a prompt is cut
never depends on what else the pass holds. A request is admitted when a
lane is free and the pool can promise its rows (prompt + max tokens + lookahead); until then it
waits, so an admitted stream never fails for memory. Runs on the engine's thread only.

n choices of one prompt (a request with `forks`) are admitted together, when n lanes are free
and the pool can promise every choice's rows, less the prompt's full pages for choices 1..n-1.
Only the first computes the prompt; in the round whose pass computes its last row, the others
fork from it: its full prompt pages are attached to their page tables (shared, the pool counts
the holders), its partial last page and its fixed state are copied, and each samples its first
token from the same logits row with its own seed. So choice i is what the same request alone
with choice i's seed would give: same pages, same state, same logits.

A request that asks for its prompt's logprobs (`Request.prompt_logprobs`: `echo` with
`logprobs`) keeps every prompt row's logits: it takes no prompt-store hit (the rows it would
resume were never computed for it; the store still keeps its marks for others), its chunks are
at most LOGPROB_ROWS rows (cut on the family's mark_rows, as a budget cut is), and once its
prompt is computed its logprobs go to it and to its choices (`PromptOut`) before any token.

A request with media (`Request.media`) is seen by the prompt store through its store key (each
media row keyed by its piece's pixels), computes each piece's rows once, in the first chunk
that holds them, and never cuts a chunk or keeps a state inside a block (`media_rows`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from tensorfold.adapters import paged_kv

from ..config.logs import get_logger
from ..family.drafter import DraftAsk, ModelDrafter
from ..family.forward_pass import LogitRows, StreamRows
from ..family.media import store_key
from ..family.model import FamilyModel
from ..family.tokenizer import IncrementalDecoder, Tokenizer
from ..memory.kv_pool import Lease
from ..memory.prompt_radix import Kept
from ..memory.prompt_share import PromptSharing
from .drafts import DraftSettings, StreamDrafts
from .media_rows import MediaRows, check_media, clean_cut
from .prompt_logprobs import LOGPROB_ROWS, Entry, prompt_rows
from .requests import Finished, PromptOut, Request, RequestRefused, TokenOut
from .runner import ModelRunner
from .sampling import RowHistory, SampleResult, launch_rows, read_rows
from .stops import StopChecker
from .structured import accept_rows, mask_rows

log = get_logger("tensorfold.lanes")

PASS_ROWS = 2048
# Decode rounds sent ahead (`Lanes.ahead`): None on a GPU only, True anywhere (tests of it on
# the CPU), False never (benchmarks compare)
DECODE_AHEAD: bool | None = None


@dataclass
class Live:
    """An admitted request on its lane."""

    req: Request
    slot: int
    lease: Lease
    stops: StopChecker
    history: RowHistory
    decoder: IncrementalDecoder | None
    pos: int = 0  # rows already in the pages and state
    next_token: int | None = None  # sampled, to be fed in the next round
    generated: list[int] = field(default_factory=list)
    cached: int = 0  # prompt rows resumed from the store
    marks: list[int] = field(default_factory=list)  # prompt positions to keep states at
    forks: list["Live"] = field(default_factory=list)  # choices 1..n-1, before they fork
    matcher: Any = (
        None  # structured output: this row's grammar state (tensorfold.engine.structured)
    )
    drafts: StreamDrafts | None = None  # its draft sources (prediction, n-gram), when any
    verify: list[int] = field(default_factory=list)  # this round's drafts, fed after next_token
    proposed: int = 0  # of them, drafted by its sources (the rest pad the pass: _pad_drafts)
    verify_run: int = -1  # this round's run's index in the pass (its taps), when it drafted
    state_rows: int = 0  # rows the slot's fixed state has taken in (past pos after a rejection)
    logit_row: int = 0  # the last pass's logit row its latest token was drawn from
    prompt_logprobs: list[Entry] | None = None  # scored so far, when its request asks for them
    # the prompt store's key of its prompt (media rows keyed by their pixels: store_key)
    key: list[int] = field(default_factory=list)
    media: MediaRows | None = None  # its media pieces, when its prompt has any
    block_waits: bool = False  # its next chunk, a whole block, did not fit the last pass

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.req.prompt)


@dataclass
class _Flight:
    """A decode round sent before the host read the tokens it feeds (they stay on the device):
    its streams, in the pass's order, and their logits views."""

    owners: list[Live]
    logits: list[torch.Tensor]


class Lanes:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        lanes: int,
        window: int,
        tokenizer: Tokenizer | None = None,
        eos_token_ids: Iterable[int] = (),
        pass_rows: int = PASS_ROWS,
        lookahead: int = 0,
        sharing: PromptSharing | None = None,
        hooks: Any = None,
        drafts: DraftSettings | None = None,
        model_drafter: ModelDrafter | None = None,
    ):
        if lanes > runner.slots.num_slots:
            raise ValueError(f"{lanes} lanes need {lanes} state slots, the runner has fewer")
        self.runner = runner
        self.pool = runner.pool
        self.window = window
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pass_rows = pass_rows
        self.cut_rows = runner.model.layout.mark_rows
        if pass_rows % self.cut_rows:
            raise ValueError(
                f"pass_rows {pass_rows} is not a multiple of the family's mark_rows {self.cut_rows}"
            )
        self.lookahead = lookahead
        self.num_lanes = lanes
        self.drafting = drafts or DraftSettings()
        self.model_drafter = model_drafter  # --draft model: the family's draft checkpoint
        # the family's share_attach hook (a forked choice's page table); the core's by default
        self.hooks = hooks or (sharing.hooks if sharing is not None else paged_kv)
        self.free_slots = list(range(lanes - 1, -1, -1))
        self.waiting: deque[Request] = deque()
        self.live: list[Live] = []  # admission order
        self.sharing = sharing
        self.uneven = 0
        self.passes = 0
        self.rows_cached = 0  # prompt rows resumed from the store, all requests together
        self.rows_computed = 0  # prompt rows prefilled
        self.tokens_out = 0  # tokens sampled, all streams together
        self.tokens_drafted = 0  # draft tokens verify rounds checked, all streams together
        self.drafts_accepted = 0  # of them, kept
        self.verify_rounds = 0  # rounds with at least one drafting stream
        # ahead: when every live stream decodes and nothing waits, the next round goes to the
        # GPU fed by this round's tokens on the device, before the host reads them, so the host's
        # work on a round overlaps the next forward. A stream that ends in between has fed one
        # row more (its lease covers it; what it keeps says so). Default (DECODE_AHEAD): on a
        # GPU, when the runner can feed a round from the device (`run_fed`; not under tensor
        # parallel).
        fed = getattr(runner, "run_fed", None) is not None
        ahead = DECODE_AHEAD
        if ahead is None:
            ahead = torch.device(runner.model.device).type == "cuda"
        self.ahead = ahead and fed
        self._flight: _Flight | None = None
        self.sent_ahead = 0  # rounds sent ahead

    @property
    def max_drafts(self) -> int:
        """k: the settings', the k + 1 rows shorter than the family's mark_rows when it has
        them (a run never holds a whole glm5_next KDA chunk: its rows stay recurrent)."""
        if self.cut_rows == 1:
            return self.drafting.tokens
        return min(self.drafting.tokens, self.cut_rows - 2)

    # -- submission (validated before it is queued) ------------------------------------------

    def check(self, req: Request) -> None:
        """Refuse a request that can never run here, naming both numbers."""
        n, m = len(req.prompt), req.params.max_tokens
        if n == 0:
            raise RequestRefused("the prompt is empty", "prompt")
        if n + m > self.window:
            raise RequestRefused(
                f"the prompt's {n} tokens plus max_tokens {m} make {n + m}, more than the "
                f"{self.window}-token window",
                "max_tokens",
            )
        check_media(req.media, n, self.pass_rows, self._no_media())
        vocab = self.runner.model.vocab_size
        if req.params.logit_bias and req.params.logit_bias[-1][0] >= vocab:
            raise RequestRefused(
                f"logit_bias key {req.params.logit_bias[-1][0]} is not a token id: ids are "
                f"0..{vocab - 1}",
                "logit_bias",
            )
        pages = self.pool.pages_for(n + m + self.lookahead)
        if req.forks:
            self._check_choices(req, pages)
        elif pages > self.pool.num_pages:
            raise RequestRefused(
                f"the prompt's {n} tokens plus max_tokens {m} need {pages} pages; the pool has "
                f"{self.pool.num_pages}",
                "max_tokens",
            )

    def _no_media(self) -> str | None:
        """The family's name when its model has no tower (encode_media not overridden)."""
        model = self.runner.model
        if type(model).encode_media is not FamilyModel.encode_media:
            return None
        return getattr(model, "name", None) or type(model).__name__

    def _check_choices(self, req: Request, pages: int) -> None:
        choices, lanes = 1 + len(req.forks), self.num_lanes
        if choices > lanes:
            raise RequestRefused(
                f"n={choices} choices decode on {choices} lanes at once and this server has "
                f"{lanes} (--parallel {lanes}); ask for n <= {lanes}",
                "n",
            )
        shared = len(req.prompt) // self.pool.page_rows
        total = pages + len(req.forks) * (pages - shared)
        if total > self.pool.num_pages:
            raise RequestRefused(
                f"n={choices} choices of the prompt's {len(req.prompt)} tokens plus max_tokens "
                f"{req.params.max_tokens} need {total} pages; the pool has "
                f"{self.pool.num_pages}; ask for a smaller n or max_tokens",
                "n",
            )

    def add(self, req: Request) -> None:
        self.check(req)
        self.waiting.append(req)

    @property
    def idle(self) -> bool:
        return not self.live and not self.waiting

    # -- one round ----------------------------------------------------------------------------

    def step(self) -> bool:
        """Run one round; False when there was nothing to do."""
        dropped = self._drop_cancelled()
        flight, self._flight = self._flight, None
        if flight is not None:  # sent last round: its rows are computed, the draws are left
            alive = {id(s) for s in self.live}
            wanting = []
            for row, (s, out) in enumerate(zip(flight.owners, flight.logits)):
                if id(s) in alive:
                    s.logit_row = row
                    wanting.append((s, out[-1:]))
            if wanting:
                self._draw(wanting)
                if self.idle:
                    self.census()
                return True
        self._admit()
        if not self.live:
            if dropped and self.idle:
                self.census()
            return False
        runs, owners = self._plan_pass()
        logits = self.runner.run(runs)
        self.passes += 1
        self.verify_rounds += any(s.verify for s in owners)
        wanting = []
        row = 0  # the pass's logit rows, stream by stream
        for i, (stream, run, out) in enumerate(zip(owners, runs, logits)):
            stream.pos = stream.state_rows = run.end
            if stream.media is not None:
                stream.media.computed(run.end)
            row += out.shape[0]
            if stream.verify:  # its rows' logits, all of them; taps to rewind to
                stream.verify_run, stream.logit_row = i, row - out.shape[0]
                wanting.append((stream, out))
                continue
            if run.taps:
                self._keep_taps(i, stream, run)
            if stream.prompt_logprobs is not None and run.start < len(stream.req.prompt):
                out = self._score_prompt(stream, run, out)
            if out.shape[0]:
                stream.logit_row = row - 1
                wanting.append((stream, out[-1:]))
                if stream.forks:  # n choices: the others start from this row's logits
                    for f in self._fork(stream):
                        f.logit_row = row - 1
                        wanting.append((f, out[-1:]))
        if wanting:
            self._draw(wanting)
        if self.idle:
            self.census()
        return True

    def _draw(self, wanting: list[tuple[Live, torch.Tensor]]) -> None:
        """One [B, V] for the round: each stream's rows (one, or a verify round's k + 1), each
        masked by its own matcher (structured output), then all drawn together, each row as it
        would be alone (sampling.launch_rows): row j of a verify round at output position
        t + j over the history plus its first j drafts, as plain decoding would draw it once
        those were its tokens. The next round sent ahead when it can be; then the tokens read
        and taken, a verify round's while its drafts agree."""
        if len(wanting) == 1 and wanting[0][1].shape[0] == 1 and not wanting[0][0].matcher:
            x = wanting[0][1]  # read where it lies: nothing masks it (one launch fewer)
        else:
            x = torch.cat([rows for _, rows in wanting])
        flat = [(s, j) for s, rows in wanting for j in range(rows.shape[0])]
        bound = [i for i, (s, j) in enumerate(flat) if s.matcher and not j]  # streams' 1st rows
        mask_rows(x, [(i, flat[i][0].matcher) for i in bound], [flat[i][0].verify for i in bound])
        rows = [
            (
                s.req.params,
                len(s.generated) + j,
                s.history.with_draft(s.verify[:j]) if j else s.history,
            )
            for s, j in flat
        ]
        pending = launch_rows(x, rows)
        if len(flat) == len(wanting):
            self._send_ahead([s for s, _ in wanting], pending.tokens)
        results = read_rows(pending)
        refused: list[str | None] = [None] * len(flat)
        alone = [i for i in bound if not flat[i][0].verify]  # a verify round's: in _take_rows
        for i, error in zip(
            alone, accept_rows([(flat[i][0].matcher, results[i].token) for i in alone])
        ):
            refused[i] = error
        at = 0
        for stream, out in wanting:
            n = out.shape[0]
            self._take_rows(stream, results[at : at + n], refused[at : at + n])
            at += n
        if self.model_drafter is not None:
            self._ask_model([s for s, _ in wanting])

    def _ask_model(self, streams: list[Live]) -> None:
        """The draft model's drafts for the round after this one, for its streams still
        decoding: read once their rows are kept and rewound, before the next pass writes."""
        asking = [
            s
            for s in streams
            if s.drafts is not None and s.drafts.model and not s.lease.released and s.drafts.wants()
        ]
        if not asking:
            return
        assert self.model_drafter is not None
        k = self.max_drafts
        asks = [  # pages as far as the drafts it may feed (a drafter may write those rows)
            DraftAsk(
                s.slot,
                s.lease.cover(s.pos + min(k, s.req.params.max_tokens - 1 - len(s.generated))),
                s.pos,
                s.generated[-1],
                s.logit_row,
            )
            for s in asking
        ]
        for s, drafts in zip(asking, self.model_drafter.propose(asks, k)):
            assert s.drafts is not None
            s.drafts.model_drafts = list(drafts)

    def _take_rows(self, s: Live, results: list[SampleResult], refused: list[str | None]) -> None:
        """A stream's rows of the round, in order: one, or a verify round's rows while each
        drew its draft (row j's draw equal to draft j + 1 makes row j + 1 plain's next row).
        Then its fixed state goes back to the last row kept, and its lease gives back the
        pages past it."""
        drafts, s.verify = s.verify, []
        start = s.pos - 1 - len(drafts)  # the row whose logits are the first result's
        self.tokens_drafted += s.proposed
        for j, (result, error) in enumerate(zip(results, refused)):
            if 0 < j <= s.proposed:  # row j is plain's next row: draft j was drawn
                assert s.drafts is not None
                s.drafts.keep()
                self.drafts_accepted += 1
            s.pos = start + j + 1
            if drafts and s.matcher is not None:  # advanced row by row, as plain would be
                error = s.matcher.accept(result.token)
            self._take(s, len(s.generated), result, error)
            s.logit_row += j > 0
            if s.lease.released:  # it ended at this row: _release settled its state
                break
            if j == len(drafts) or result.token != drafts[j]:
                break
        if s.proposed:
            assert s.drafts is not None
            s.drafts.settle()
        if drafts and not s.lease.released:
            self._settle(s)

    def _settle(self, s: Live) -> None:
        """A verify round's stream back to its last kept row: its fixed state as the pass
        tapped it there (when it took in rows past it) and no page past the next row."""
        if s.state_rows != s.pos:
            self.runner.rewind_slot(s.slot, (s.verify_run, s.pos))
            s.state_rows = s.pos
        s.lease.trim(s.pos + 1)

    def _send_ahead(self, streams: list[Live], tokens: torch.Tensor) -> None:
        """The next round, each stream's row fed the token this round drew for it (`tokens`
        [B], still on the device), when it would be this round's streams' decode rows alone:
        every live stream is among them (they are live and distinct, so equal counts say so;
        a prompt still filling, or a choice waiting to fork, makes them fewer) and no request
        waits to be admitted (it is, a round later)."""
        if not self.ahead or self.waiting or len(streams) != len(self.live):
            return
        if any(s.drafts is not None and s.drafts.wants() for s in streams):
            return  # a drafting stream's next round depends on what the host reads
        runs = [StreamRows(s.slot, s.pos, [0], s.lease.cover(s.pos + 1)) for s in streams]
        logits = self.runner.run_fed(runs, tokens)  # type: ignore[attr-defined]
        self.passes += 1
        self.sent_ahead += 1
        for s, run in zip(streams, runs):
            s.pos = s.state_rows = run.end
        self._flight = _Flight(streams, logits)

    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            req = self.waiting[0]
            if req.cancelled:
                self.waiting.popleft()
                self._finish_unadmitted(req, "cancelled")
                continue
            if len(self.free_slots) < 1 + len(req.forks):
                break  # n choices wait for n lanes, in order
            rows = len(req.prompt) + req.params.max_tokens + self.lookahead
            kept = None
            key = store_key(req.prompt, req.media) if req.media else req.prompt
            if self.sharing is not None and req.prompt_logprobs is None:
                kept = self._match(key, req)
            attached = kept.pos // self.pool.page_rows if kept else 0
            shared = len(req.prompt) // self.pool.page_rows  # a fork's attached prompt pages
            need = self.pool.pages_for(rows) - attached
            need += len(req.forks) * (self.pool.pages_for(rows) - shared)
            if not self.pool.can_promise(need):
                if self.sharing is None or not self.sharing.make_room(need, keep=kept):
                    break  # waits for pages; later requests wait behind it, in order
            self.waiting.popleft()
            s = self._new_live(req, rows, attached, key)
            s.forks = [self._new_live(f, rows, shared, key) for f in req.forks]
            if kept is not None:
                s.pos = s.cached = self.sharing.resume(kept, s.lease, s.slot)  # type: ignore[union-attr]
            if self.sharing is not None:
                s.marks = self.sharing.marks(key, req.marks, s.pos)
                if s.media is not None:  # no keep inside a block: it is computed whole
                    s.marks = s.media.outside(s.marks)
            self.rows_cached += s.cached
            self.rows_computed += len(req.prompt) - s.cached
            self.live.append(s)

    def _match(self, key: list[int], req: Request) -> Kept | None:
        """The store's longest kept prefix of the prompt (by its store key), never one ending
        strictly inside a media block (a state kept there by a prompt whose block ended the
        same way would leave this one's block cut): then the longest before that block."""
        assert self.sharing is not None
        kept = self.sharing.match(key)
        while kept is not None:
            block = next((m for m in req.media if m.block and m.start < kept.pos < m.end), None)
            if block is None:
                return kept
            kept = self.sharing.match(key, limit=block.start)
        return None

    def _new_live(self, req: Request, rows: int, attached: int, key: list[int]) -> Live:
        return Live(
            req=req,
            slot=self.free_slots.pop(),
            lease=self.pool.lease(rows, attached),
            stops=StopChecker.for_params(req.params, self.eos_token_ids),
            history=RowHistory(req.prompt),
            decoder=IncrementalDecoder(self.tokenizer, keep=frozenset(req.params.keep_special_ids))
            if self.tokenizer
            else None,
            matcher=req.params.constraint.start() if req.params.constraint else None,
            drafts=self._stream_drafts(req),
            prompt_logprobs=[] if req.prompt_logprobs is not None else None,
            key=key,
            media=MediaRows(req.media) if req.media else None,
        )

    def _stream_drafts(self, req: Request) -> StreamDrafts | None:
        """Draft sources for a request: its prediction, and the server's source."""
        if not req.prediction and self.drafting.source == "off":
            return None
        return StreamDrafts(self.drafting, req.prompt, req.prediction)

    def _fork(self, parent: Live) -> list[Live]:
        """Choices 1..n-1 start from `parent`, whose prompt the last pass completed: its full
        prompt pages shared, its partial last page and its fixed state copied."""
        forks, parent.forks = parent.forks, []
        n = len(parent.req.prompt)
        table = parent.lease.pages[: self.pool.pages_for(n)]
        started = []
        for f in forks:
            if f.req.cancelled:
                self._drop_fork(f, "cancelled")
                continue
            self.runner.attach(self.hooks, f.lease, table, n)
            self.runner.copy_slot(parent.slot, f.slot)
            f.pos = f.state_rows = n
            started.append(f)
        at = self.live.index(parent) + 1
        self.live[at:at] = started
        return started

    def _drop_fork(self, f: Live, reason: str, error: str | None = None) -> None:
        """A choice that never forked (its prompt's stream ended first, or it was cancelled)."""
        f.lease.release()
        f.matcher = None
        self.free_slots.append(f.slot)
        self._finish_unadmitted(f.req, reason, error)

    def _plan_pass(self) -> tuple[list[StreamRows], list[Live]]:
        runs, owners = [], []
        decoding = [s for s in self.live if not s.prefilling and s.next_token is not None]
        uniform = self._uniform_rows(decoding)
        # draft rows a pass may hold: fewer as the batch grows, none past pass_rows streams
        spare = self.drafting.pass_rows - len(decoding)
        for s in decoding:
            left = s.req.params.max_tokens - 1 - len(s.generated)
            cap = min(self.max_drafts, left, spare) if not uniform else uniform[-1] - 1
            valid = s.matcher.valid_drafts if s.matcher is not None else None
            s.verify = s.drafts.propose(cap, valid) if s.drafts is not None and cap > 0 else []
            s.proposed = len(s.verify)
            spare -= len(s.verify)
        if uniform:
            self._pad_drafts(decoding, uniform)
        for s in decoding:
            assert s.next_token is not None
            fed = [s.next_token, *s.verify]
            pages = s.lease.cover(s.pos + len(fed))
            if s.verify:
                drafted = range(s.pos + 1, s.pos + len(fed))
                runs.append(StreamRows(s.slot, s.pos, fed, pages, "all", drafted, rewind=True))
            else:
                runs.append(StreamRows(s.slot, s.pos, fed, pages))
            owners.append(s)
        budget = self.pass_rows
        first = True  # the round's first prompt chunk may pass the budget (a whole block)
        # New prompts' first rows go before fills already under way (each group in admission
        # order), so a short prompt never waits behind a long prompt's fill; a block that
        # waited for room goes first of all, so new prompts never starve it.
        filling = sorted(
            (s for s in self.live if s.prefilling), key=lambda s: (not s.block_waits, s.pos > 0)
        )
        for s in filling:
            if budget <= 0:
                break
            grid_end = (s.pos // self.pass_rows + 1) * self.pass_rows
            end = min(len(s.req.prompt), grid_end)
            rows = budget
            if s.prompt_logprobs is not None:  # every row's logits: fewer rows a pass
                rows = min(budget, max(LOGPROB_ROWS // self.cut_rows, 1) * self.cut_rows)
            if s.pos + rows < end:  # the budget ends it early: on the family's grid
                end = (s.pos + rows) // self.cut_rows * self.cut_rows
            if s.media is not None and s.media.blocks:  # never strictly inside a block
                end = clean_cut(s.pos, end, len(s.req.prompt), self.cut_rows, s.media.blocks)
                s.block_waits = end - s.pos > budget and not first
                if s.block_waits:
                    continue  # a whole block that does not fit: it goes first next round
            if end <= s.pos:
                continue
            tokens = s.req.prompt[s.pos : end]
            last = end == len(s.req.prompt)
            pages = s.lease.cover(end)
            taps = [m for m in s.marks if s.pos < m <= end]
            wants: LogitRows = (
                "all" if s.prompt_logprobs is not None else "last" if last else "none"
            )
            embeds: list[tuple[int, torch.Tensor]] = []
            blocks: list[tuple[int, int]] = []
            if s.media is not None:
                embeds, blocks = s.media.run_parts(s.pos, end, self.runner.encode_media)
            run = StreamRows(
                s.slot, s.pos, tokens, pages, wants, taps, embeds=embeds, blocks=blocks
            )
            runs.append(run)
            owners.append(s)
            budget -= len(tokens)
            first = False
        return runs, owners

    def _score_prompt(self, s: Live, run: StreamRows, out: torch.Tensor) -> torch.Tensor:
        """A prompt chunk's rows of a stream that keeps them (`out`: every row's logits): the
        prompt tokens they score, added to its prompt logprobs, sent once its prompt is
        whole, to it and to its choices. Returns the rows left to sample: the last, at the
        prompt's end, else none."""
        assert s.prompt_logprobs is not None and s.req.prompt_logprobs is not None
        prompt = s.req.prompt
        targets = prompt[run.start + 1 : run.end + 1]
        s.prompt_logprobs += prompt_rows(out[: len(targets)], targets, s.req.prompt_logprobs)
        if run.end < len(prompt):
            return out[:0]
        for r in [s.req] + [f.req for f in s.forks]:
            r.sink(PromptOut(r.id, list(s.prompt_logprobs)))
        return out[-1:]

    def _uniform_rows(self, decoding: list[Live]) -> tuple[int, ...]:
        """The rows a stream (k + 1) a verify pass of these streams may be padded to, when the
        runner runs a pass faster with every stream's the same (a CUDA graph's; ModelRunner.
        verify_row_counts): those every stream can take (max_tokens, the family's k) within
        pass_rows rows, up to the one whose pass pays best (`_paying`); (1,) when none can or
        none pays (a stream at its last token, more than pass_rows / 2 streams, too few
        drafts expected to be kept): no drafts this round, whose pass is then a graphed decode
        round. () when no such pass is to be had: drafts as they come, run eagerly (a prompt
        chunk in the pass makes it one no graph replays)."""
        counts = self.runner.verify_row_counts(len(decoding))
        if not counts or not decoding or any(s.prefilling for s in self.live):
            return ()
        wanting = [s.drafts for s in decoding if s.drafts is not None and s.drafts.wants()]
        if not wanting:
            return ()
        most = min(s.req.params.max_tokens - 1 - len(s.generated) for s in decoding)
        most = min(most, self.max_drafts, self.drafting.pass_rows // len(decoding) - 1)
        fits = tuple(r for r in counts if r - 1 <= most)
        if fits and self.drafting.adaptive:
            fits = self._paying(fits, len(decoding), wanting)
        return fits or (1,)

    def _paying(
        self, fits: tuple[int, ...], streams: int, wanting: list[StreamDrafts]
    ) -> tuple[int, ...]:
        """`fits` up to the R whose padded pass yields the most tokens for its price, () when
        none yields more than the plain round's one a stream: each drafting stream's expected
        tokens at min(its policy's k, R - 1) drafts, one for each other, against `streams`
        times a verify pass's price at one stream (DraftSettings.verify_cost; a larger batch
        pays less a row than that, so this errs towards plain rounds). A stream ending its pause
        gets at least its one probing draft, whatever the pass yields: else a stream once paused
        would wait for a probe no pass lets through, and never draft again."""
        probing = any(d.policy.pause_left == 1 for d in wanting)
        best, best_r = 1.0, fits[0] if probing else 0  # a paused stream's probe is let through
        ks = [max(d.policy.best_k(), 1) for d in wanting]
        for r in fits:
            tokens: float = streams - len(wanting)
            tokens += sum(d.policy.expected(min(r - 1, k)) for d, k in zip(wanting, ks))
            gain = tokens / (streams * self.drafting.verify_cost(r))
            if gain > best:
                best, best_r = gain, r
        return tuple(r for r in fits if r <= best_r)

    def _pad_drafts(self, decoding: list[Live], counts: tuple[int, ...]) -> None:
        """Every stream's drafts padded to the same count (R - 1 for the smallest R in `counts`
        that holds the longest), so the pass is one a graph replays. A filler draft is its
        stream's last token again: a draft like any other, kept when drawn (the verify round
        keeps plain's tokens whatever it is fed), never counted as drafted. No padding when
        nothing was drafted, or when a stream under a grammar would need fillers (its masks
        follow its drafts: a filler may be one its grammar refuses)."""
        longest = max(len(s.verify) for s in decoding)
        if not longest:
            return
        r = next(r for r in counts if r - 1 >= longest)
        if any(s.matcher is not None and len(s.verify) < r - 1 for s in decoding):
            return
        for s in decoding:
            assert s.next_token is not None
            s.verify += [(s.verify or [s.next_token])[-1]] * (r - 1 - len(s.verify))

    def _keep_taps(self, i: int, s: Live, run: StreamRows) -> None:
        assert self.sharing is not None and self.runner.last_pass is not None
        tapped = self.runner.last_pass.tapped
        for p in run.taps:
            if (i, p) not in tapped and p < run.end and self.runner.slots.buffers:
                continue  # the family did not tap mid-pass: no exact state to keep there
            self.sharing.keep(s.key[:p], s.lease.pages, s.slot, (i, p))

    def _take(self, s: Live, t: int, result: SampleResult, refused: str | None = None) -> None:
        """A row's sampled token; `refused`: its grammar's error, when it refused the token."""
        s.generated.append(result.token)
        self.tokens_out += 1
        s.history.append(result.token)
        if s.drafts is not None:
            s.drafts.append(result.token)
        if refused:  # the grammar failed (a step past its budget): the row stops, others go on
            constraint = s.req.params.constraint
            assert constraint is not None
            message = constraint.stopped(refused, len(s.generated) - 1)
            log.warning("a grammar failed mid-generation", request=s.req.id, error=message)
            self._release(s, "error", message)
            return
        piece = s.decoder.step([result.token]) if s.decoder else ""
        step = s.stops.feed(result.token, piece)
        s.req.sink(
            TokenOut(s.req.id, t, result.token, step.text, result.logprob, result.top_logprobs)
        )
        if step.finish_reason is not None:
            cut_at_stop_string = isinstance(step.stop_reason, str)
            self._release(s, step.finish_reason, flush=not cut_at_stop_string)
        else:
            s.next_token = result.token

    # -- endings ------------------------------------------------------------------------------

    def _drop_cancelled(self) -> bool:
        """End cancelled requests, live or waiting; True if any ended."""
        live = [s for s in self.live if s.req.cancelled]
        for s in live:
            self._release(s, "cancelled")
        waiting = [r for r in self.waiting if r.cancelled]
        for req in waiting:
            self.waiting.remove(req)
            self._finish_unadmitted(req, "cancelled")
        return bool(live or waiting)

    def _release(self, s: Live, reason: str, error: str | None = None, flush: bool = True) -> None:
        if s.state_rows > s.pos and not s.prefilling:
            self._settle(s)  # ended inside a verify round: the state it keeps is its last row's
        self.live.remove(s)
        for f in s.forks:  # ended before its prompt was computed: so do its other choices
            self._drop_fork(f, reason, error)
        s.forks = []
        if self.sharing is not None and reason in ("stop", "length") and not s.prefilling:
            # where this turn ended: the next turn of a chat resumes here
            fed = s.key + s.generated[: s.pos - len(s.req.prompt)]
            self.sharing.keep(fed, s.lease.pages, s.slot, None)
        s.lease.release()
        s.matcher = None  # the grammar state goes with the stream
        if self.pool.poison_freed:
            self.runner.poison_slot(s.slot)
        self.free_slots.append(s.slot)
        # Text still held back (a partial character, a possible stop string's start) goes out,
        # unless the stream ended at a stop string, after which nothing is released.
        tail = ""
        if flush:
            tail = s.stops.flush() + (s.decoder.flush() if s.decoder else "")
        d = s.drafts
        s.req.sink(
            Finished(
                s.req.id,
                reason,  # type: ignore[arg-type]
                tail,
                len(s.req.prompt),
                len(s.generated),
                s.cached,
                s.req.params.seed,
                error,
                *(
                    (d.drafted, d.accepted, d.prediction_accepted, d.prediction_rejected)
                    if d
                    else ()
                ),
            )
        )

    def _finish_unadmitted(self, req: Request, reason: str, error: str | None = None) -> None:
        for f in req.forks:  # n choices: the others end with it
            self._finish_unadmitted(f, reason, error)
        req.sink(Finished(req.id, reason, "", len(req.prompt), 0, 0, req.params.seed, error))  # type: ignore[arg-type]

    def fail_all(self, error: str) -> None:
        """End every request with an error (the forward raised): lanes and pages come back."""
        self._flight = None
        for s in list(self.live):
            self._release(s, "error", error)
        while self.waiting:
            self._finish_unadmitted(self.waiting.popleft(), "error", error)

    def census(self) -> bool:
        census = self.pool.census()
        if census.idle_even:  # after every drain: debug, so a busy server's log is not all census
            log.debug(census.line())
            return True
        self.uneven += 1
        log.error("UNEVEN " + census.line(), live=census.live)
        return False
