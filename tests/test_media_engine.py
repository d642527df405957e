"""Media pieces through the engine (issue 59): the lanes compute each piece's rows once, place
them in the prompt chunks that hold them, never cut a chunk or keep a state inside a block, and
key them in the prompt store by the piece's pixels. On lfm2_moe's demo wrapped as a family
with a tower (`Pictured`: a piece's rows are embedding rows drawn from its seed), in fp32 on
the CPU: concurrent == solo, resumed == fresh, a different image no hit, the census even."""

from __future__ import annotations

import copy
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import pytest
import torch

from tensorfold.adapters import paged_kv, snapshots
from tensorfold.adapters.snapshots import SnapshotArena
from tensorfold.engine.choices import choice_seed
from tensorfold.engine.drafts import DraftSettings
from tensorfold.engine.engine import Engine
from tensorfold.engine.lanes import Lanes
from tensorfold.engine.media_rows import clean_cut
from tensorfold.engine.requests import Finished, Request, RequestRefused, TokenOut
from tensorfold.engine.runner import ModelRunner
from tensorfold.engine.sampling import SamplingParams
from tensorfold.family import FamilySpec
from tensorfold.family.checkpoint import Checkpoint
from tensorfold.family.forward_pass import ForwardPass
from tensorfold.family.media import MediaPiece, media_key
from tensorfold.family.model import FamilyModel
from tensorfold.family.plugins import family_plugin_manager
from tensorfold.memory.prompt_share import PromptSharing

HOLE = 7  # the placeholder id of image rows
PASS_ROWS = 32  # small, so the pass grid falls inside images
PAGE_ROWS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True)


class Placed:
    """An embedding table whose lookups take the pass's media rows (ForwardPass.place_embeds)."""

    def __init__(self, table: torch.Tensor, fp: ForwardPass):
        self.table, self.fp = table, fp

    def index_select(self, dim: int, ids: torch.Tensor) -> torch.Tensor:
        return self.fp.place_embeds(self.table.index_select(dim, ids))


class Pictured(FamilyModel):
    """lfm2_moe's demo with a tower: a piece's `inputs` is a seed, its rows are embedding rows
    of tokens drawn from it. Records each encode_media call and each pass's runs."""

    def __init__(self, inner: Any):
        # its own weights record: the forward swaps its embedding table for a pass
        self.inner = copy.copy(inner)
        self.inner.weights = copy.copy(inner.weights)
        self.name = "pictured"
        self.layout = inner.layout
        self.vocab_size = inner.vocab_size
        self.max_positions = inner.max_positions
        self.device = inner.device
        self.dtype = inner.dtype
        self.encoded: list[list[int]] = []  # the pieces' keys, a call
        # each pass's runs: (slot, start, end, blocks, taps, the pass's number)
        self.runs: list[tuple[int, int, int, tuple, tuple, int]] = []
        self.passes = 0

    def forward(self, fp: ForwardPass, rows: Any, slots: Any) -> torch.Tensor:
        self.passes += 1
        self.runs += [
            (s.slot, s.start, s.end, tuple(s.blocks), tuple(s.taps), self.passes)
            for s in fp.streams
        ]
        w = self.inner.weights
        table, w.embed = w.embed, Placed(w.embed, fp)
        try:
            return self.inner.forward(fp, rows, slots)
        finally:
            w.embed = table

    def encode_media(self, pieces: Sequence[MediaPiece]) -> list[torch.Tensor]:
        self.encoded.append([p.key for p in pieces])
        table = self.inner.weights.embed
        out = []
        for p in pieces:
            drawn = torch.randint(
                8, table.shape[0], (p.rows,), generator=torch.Generator().manual_seed(p.inputs)
            )
            out.append(table.index_select(0, drawn.to(table.device)))
        return out


@pytest.fixture(scope="module")
def inner(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tensorfold_lfm2_moe.demo import build_demo
    from tensorfold_lfm2_moe.model import load

    folder = build_demo(tmp_path_factory.mktemp("media-demo"))
    return load(Checkpoint.open(Path(folder)), "cpu", "float32")


def open_lanes(
    model: FamilyModel,
    *,
    lanes: int = 4,
    pass_rows: int = PASS_ROWS,
    share: int = 0,
    drafts: DraftSettings | None = None,
    runner_cls: type[ModelRunner] = ModelRunner,
) -> Lanes:
    """The lanes over 96 pages of 16 rows, freed pages poisoned; with the prompt store when
    `share` (its kept states) is set, 32 of those pages its cache."""
    hooks = family_plugin_manager(FamilySpec("pictured", "x:y", "x:y"), [paged_kv, snapshots])
    runner = runner_cls(
        model, num_pages=96, num_slots=lanes, page_rows=PAGE_ROWS, poison=True, plugin_manager=hooks
    )
    sharing = None
    if share:
        sharing = PromptSharing(
            pool=runner.pool,
            runner=runner,
            arena=SnapshotArena(model.layout.fixed, share, str(model.device)),
            hooks=hooks.hook,
            max_states=share,
            cache_pages=32,
            mark_rows=model.layout.mark_rows,
            grid=pass_rows,
        )
    return Lanes(
        runner,
        lanes=lanes,
        window=1024,
        pass_rows=pass_rows,
        sharing=sharing,
        hooks=hooks.hook,
        drafts=drafts,
    )


def open_engine(model: FamilyModel, **kw: Any) -> Engine:
    """An engine on `open_lanes(model, **kw)`, started."""
    return Engine(open_lanes(model, **kw)).start()


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Engines a test opens (append them): stopped after it, each census even."""
    opened: list[Engine] = []
    yield opened
    for engine in opened:
        engine.stop(timeout=60)
        assert_even(engine)


def assert_even(engine: Engine) -> None:
    lanes = engine.lanes
    assert lanes.uneven == 0 and lanes.pool.census().idle_even, lanes.pool.census().line()


class Reply:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finished: Finished | None = None
        self.done = threading.Event()

    def __call__(self, event: Any) -> None:
        if isinstance(event, TokenOut):
            self.tokens.append(event.token)
        elif isinstance(event, Finished):
            self.finished = event
            self.done.set()


def wait(replies: Sequence[Reply]) -> None:
    for r in replies:
        assert r.done.wait(120), "a request did not finish in 120 s"
        assert r.finished is not None and r.finished.error is None, r.finished


Prompt = tuple[list[int], tuple[MediaPiece, ...]]


def prompt(seed: int, layout: Sequence[int | tuple[int, int, bool]]) -> Prompt:
    """Text runs (an int: that many ids drawn from `seed`) and images ((rows, image seed,
    block)) in order: the ids (HOLE at image rows) and the pieces."""
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    pieces = []
    for part in layout:
        if isinstance(part, int):
            ids += torch.randint(8, 1000, (part,), generator=g).tolist()
        else:
            rows, image, block = part
            pieces.append(MediaPiece(len(ids), rows, media_key(b"image", image), image, block))
            ids += [HOLE] * rows
    return ids, tuple(pieces)


def submit(
    engine: Engine,
    p: Prompt,
    params: SamplingParams = GREEDY,
    marks: Sequence[int] = (),
    prediction: Sequence[int] = (),
) -> Reply:
    reply = Reply()
    engine.submit(p[0], params, reply, marks, prediction, media=p[1])
    return reply


def alone(engine: Engine, p: Prompt, params: SamplingParams = GREEDY, **kw: Any) -> Reply:
    reply = submit(engine, p, params, **kw)
    wait([reply])
    assert_even(engine)
    return reply


# prompts the pass grid (32) cuts inside an image: a block, a plain piece, two images, text
PROMPTS = [
    prompt(1, [20, (24, 101, True), 9]),  # block [20, 44): the grid's 32 inside it
    prompt(2, [11]),
    prompt(3, [5, (40, 102, False), 4]),  # a plain piece across the grid: cut there
    prompt(4, [30, (6, 103, True), 3, (20, 104, True), 40]),  # blocks [30, 36), [39, 59)
    prompt(5, [(12, 105, True), 17]),  # an image first
]


def assert_no_cut_inside_a_block(model: Pictured, prompts: Sequence[Prompt]) -> None:
    blocks = {(m.start, m.end) for _, pieces in prompts for m in pieces if m.block}
    for _slot, start, end, run_blocks, taps, _pass in model.runs:
        for a, b in blocks:
            assert not a < start < b and not a < end < b or (a, b) not in run_blocks
        for a, b in run_blocks:  # a run holds a block whole
            assert start <= a and b <= end, (start, end, a, b)
        assert not any(a < t < b for t in taps for a, b in run_blocks)


def test_concurrent_equals_solo_with_images_among_text(inner: Any, engines: list[Engine]):
    model = Pictured(inner)
    engine = open_engine(model)
    engines.append(engine)
    for params in (GREEDY, SAMPLED):
        solo = [alone(engine, p, params).tokens for p in PROMPTS]
        together = [submit(engine, p, params) for p in PROMPTS]
        wait(together)
        assert_even(engine)
        assert [r.tokens for r in together] == solo
        assert all(
            r.finished is not None and r.finished.prompt_tokens == len(p[0])
            for r, p in zip(together, PROMPTS)
        )
    # each chunk of a block holds it whole: the plan moved or stretched the grid's cut
    block_runs = [r for r in model.runs if r[3]]
    assert block_runs and all(r[1] <= a and b <= r[2] for r in block_runs for a, b in r[3])
    assert any(r[2] % PASS_ROWS for r in block_runs)  # some cut off the grid for a block
    # one encode_media call a chunk that needs pieces, each piece once a request
    pieces = sum(len(p[1]) for p in PROMPTS)
    assert sum(len(keys) for keys in model.encoded) == 4 * pieces


def test_a_pass_too_small_for_a_block_waits_and_never_starves(inner: Any, engines: list[Engine]):
    """A block that does not fit the rows left in a pass waits for the next round, where it
    goes first; chunking never changes the tokens."""
    wide = Pictured(inner)
    engines.append(wide_engine := open_engine(wide, pass_rows=256))
    want = [alone(wide_engine, p).tokens for p in PROMPTS]
    model = Pictured(inner)
    engines.append(engine := open_engine(model, pass_rows=PASS_ROWS))
    texts = [prompt(10 + i, [25]) for i in range(3)]
    replies = [submit(engine, p) for p in [*texts, *PROMPTS]]
    wait(replies)
    assert [r.tokens for r in replies[3:]] == want
    assert_no_cut_inside_a_block(model, PROMPTS)


def test_a_block_that_waited_goes_first(inner: Any):
    """Short prompts keep arriving, each taking a new prompt's place at the head of a pass: a
    block that found no room goes first in the next pass, before they are all done."""
    model = Pictured(inner)
    lanes = open_lanes(model, lanes=3)
    ids, pieces = prompt(15, [20, (24, 115, True), 4])
    lanes.add(Request(ids, GREEDY.with_seed(), Reply(), media=pieces))
    short = replace(GREEDY, max_tokens=1).with_seed()
    for i in range(12):
        lanes.add(Request(prompt(30 + i, [20])[0], short, Reply()))
    for _ in range(200):
        if not lanes.step():
            break
    assert lanes.idle and lanes.census()
    block = next(r[5] for r in model.runs if r[3])
    assert block < max(r[5] for r in model.runs if r[0] != model.runs[0][0] and r[1] == 0)


def test_a_piece_is_computed_once_whatever_the_chunks(inner: Any, engines: list[Engine]):
    model = Pictured(inner)
    engines.append(engine := open_engine(model, pass_rows=16))
    p = prompt(6, [3, (50, 106, False), 2])  # chunks of 16 rows: four hold its rows
    reply = alone(engine, p)
    assert model.encoded == [[p[1][0].key]]
    assert len(model.runs) >= 4
    wide = Pictured(inner)
    engines.append(wide_engine := open_engine(wide, pass_rows=64))
    assert alone(wide_engine, p).tokens == reply.tokens


def test_the_image_reaches_the_model(inner: Any, engines: list[Engine]):
    """Another image at the same rows changes the tokens; the same image gives the same."""
    engines.append(engine := open_engine(Pictured(inner)))
    ids, (piece,) = prompt(1, [20, (24, 101, True), 9])
    other = replace(piece, key=media_key(b"image", 201), inputs=201)
    first = alone(engine, (ids, (piece,))).tokens
    assert alone(engine, (ids, (piece,))).tokens == first
    assert alone(engine, (ids, (other,))).tokens != first
    plain = alone(engine, (ids, ())).tokens  # the placeholders' own embeddings
    assert plain != first


def test_resumed_equals_fresh_with_an_image_in_the_kept_prefix(inner: Any, engines: list[Engine]):
    model = Pictured(inner)
    engines.append(kept := open_engine(model, share=16))
    engines.append(fresh := open_engine(Pictured(inner)))
    ids, pieces = prompt(7, [13, (24, 107, True), 6])
    first = alone(kept, (ids, pieces), SAMPLED)
    assert first.finished is not None and first.finished.cached_tokens == 0
    # the next turn: the first turn's prompt and reply, then more text; it resumes where the
    # first turn ended (its last token not fed yet)
    turn = ids + first.tokens + prompt(8, [9])[0]
    before = len(model.encoded)
    resumed = alone(kept, (turn, pieces), SAMPLED)
    assert resumed.finished is not None
    assert resumed.finished.cached_tokens == len(ids) + len(first.tokens) - 1
    assert len(model.encoded) == before  # the image lay inside the hit: never computed again
    assert resumed.tokens == alone(fresh, (turn, pieces), SAMPLED).tokens
    # a different image in the same place: no hit past its first row
    other = (replace(pieces[0], key=media_key(b"image", 208), inputs=208),)
    missed = alone(kept, (turn, other), SAMPLED)
    assert missed.finished is not None and missed.finished.cached_tokens <= pieces[0].start
    assert missed.tokens == alone(fresh, (turn, other), SAMPLED).tokens
    # no state is kept inside a block
    blocks = [(m.start, m.end) for m in pieces]
    assert all(not a < k.pos < b for k in kept.lanes.sharing.store.kept() for a, b in blocks)
    assert_no_cut_inside_a_block(model, [(turn, pieces)])


def test_a_mark_inside_a_block_is_not_kept(inner: Any, engines: list[Engine]):
    model = Pictured(inner)
    engines.append(engine := open_engine(model, share=16))
    ids, pieces = prompt(9, [10, (30, 109, True), 5])  # the grid's 32 and a chat mark inside
    alone(engine, (ids, pieces), marks=[20, len(ids)])
    kept = sorted(k.pos for k in engine.lanes.sharing.store.kept())
    assert kept and not any(10 < k < 40 for k in kept)
    assert not any(10 < t < 40 for run in model.runs for t in run[4])
    # a state kept inside those rows (the same image, not a block there) is never resumed
    plain = (replace(pieces[0], block=False),)
    alone(engine, (ids, plain), marks=[20])
    assert any(k.pos == 20 for k in engine.lanes.sharing.store.kept())
    resumed = alone(engine, (ids, pieces))
    assert resumed.finished is not None and resumed.finished.cached_tokens <= 10


def test_n_choices_with_an_image_equal_their_single_twins(inner: Any, engines: list[Engine]):
    model = Pictured(inner)
    engines.append(engine := open_engine(model))
    ids, pieces = prompt(11, [18, (24, 111, True), 5])
    replies = [Reply(), Reply()]
    params = [replace(SAMPLED, seed=choice_seed(5, i)) for i in range(2)]
    engine.submit_n(ids, params, replies, media=pieces)
    wait(replies)
    assert len(model.encoded) == 1  # the prompt once
    for p, r in zip(params, replies):
        assert alone(engine, (ids, pieces), p).tokens == r.tokens
    assert replies[0].tokens != replies[1].tokens


def test_drafted_equals_plain_with_an_image(inner: Any, engines: list[Engine]):
    """Drafts from a prediction (half of it wrong) and n-grams over the prompt's ids, the
    image's placeholders among them: the tokens are plain decoding's."""
    ids, pieces = prompt(12, [(20, 112, True), 6])
    engines.append(plain := open_engine(Pictured(inner)))
    engines.append(drafted := open_engine(Pictured(inner), drafts=DraftSettings("ngram", 3)))
    params = replace(GREEDY, max_tokens=12)
    want = alone(plain, (ids, pieces), params).tokens
    guess = want[:6] + [HOLE] * 6
    assert alone(drafted, (ids, pieces), params, prediction=guess).tokens == want
    assert drafted.lanes.drafts_accepted >= 3


def test_prompt_logprobs_with_an_image_stream_whole_blocks(inner: Any, engines: list[Engine]):
    model = Pictured(inner)
    engines.append(engine := open_engine(model, pass_rows=256))
    ids, pieces = prompt(13, [100, (150, 113, True), 10])  # a block past LOGPROB_ROWS (128)
    replies = [Reply()]
    engine.submit_n(ids, [GREEDY], replies, prompt_logprobs=1, media=pieces)
    wait(replies)
    assert any(r[1] <= 100 and r[2] >= 250 for r in model.runs)  # the block in one chunk
    assert replies[0].tokens == alone(engine, (ids, pieces)).tokens


def test_refusals(inner: Any, engines: list[Engine]):
    engines.append(engine := open_engine(Pictured(inner)))
    ids, pieces = prompt(14, [4, (6, 114, True), 4])
    bad = {
        "outside the prompt": (replace(pieces[0], start=40),),
        "overlapping": (pieces[0], replace(pieces[0], start=6)),
        "a block of 40 rows": (MediaPiece(0, 40, 1, 1, True),),
    }
    for words, media in bad.items():
        with pytest.raises(RequestRefused, match=words) as refused:
            engine.submit(ids + [HOLE] * 30, GREEDY, Reply(), media=media)
        assert refused.value.param == "messages"
    engines.append(plain := open_engine(inner))
    with pytest.raises(RequestRefused, match="the lfm2_moe family takes no images"):
        plain.submit(ids, GREEDY, Reply(), media=pieces)
    assert alone(plain, (ids, ())).tokens  # text still served


@pytest.mark.parametrize(
    ("pos", "end", "cut_rows", "blocks", "want"),
    [
        (0, 32, 1, [(20, 44)], 20),  # back to the block's start
        (20, 32, 1, [(20, 44)], 44),  # it starts the chunk: on to its end
        (0, 32, 1, [(32, 40)], 32),  # on a block's edge: clean
        (0, 30, 8, [(20, 44)], 16),  # back, then down to the family's cut
        (16, 30, 8, [(20, 44)], 48),  # nothing clean after 16: up, then to the family's cut
        (40, 50, 8, [(20, 44)], 48),
        (0, 62, 8, [(56, 66)], 56),
        (56, 60, 8, [(56, 66)], 66),  # the prompt's end is clean
    ],
)
def test_clean_cuts(pos, end, cut_rows, blocks, want):
    assert clean_cut(pos, end, 66, cut_rows, blocks) == want


def test_under_tensor_parallel_rank_0s_tower_rows_reach_every_rank():
    """Rank 0 alone runs the tower; each pass sends its media rows (on the CPU) with the
    streams, and a follower's pass places the same rows."""
    from test_tensor_parallel import CountModel, Wire

    from tensorfold.engine.tensor_parallel import Follower, Leader, Team

    class CountPictured(CountModel):
        def __init__(self) -> None:
            self.placed: list[torch.Tensor] = []
            self.encoded = 0

        def forward(self, fp: ForwardPass, rows: Any, slots: Any) -> torch.Tensor:
            if fp.embed_values is not None:
                self.placed.append(fp.embed_values.clone())
            return super().forward(fp, rows, slots)

        def encode_media(self, pieces: Sequence[MediaPiece]) -> list[torch.Tensor]:
            self.encoded += len(pieces)
            return [torch.full((p.rows, 4), float(p.inputs)) for p in pieces]

    def rank(model: CountPictured) -> Any:
        hooks = family_plugin_manager(FamilySpec("count", "x:y", "x:y"), [paged_kv, snapshots])
        runner = ModelRunner(model, num_pages=16, num_slots=2, page_rows=16, plugin_manager=hooks)
        for buf in runner.rows.buffers.values():
            buf.zero_()
        return type("Rank", (), {"runner": runner, "hooks": hooks.hook, "arena": None})()

    wire = Wire()
    lead, follow = CountPictured(), CountPictured()
    lanes = Lanes(Leader(rank(lead).runner, Team(wire)), lanes=2, window=256, pass_rows=32)
    image = MediaPiece(10, 30, media_key(b"image", 3), 3)  # [10, 40): across the grid
    lanes.add(
        Request([1] * 10 + [HOLE] * 30 + [2] * 5, GREEDY.with_seed(), Reply(), media=(image,))
    )
    lanes.add(Request([3] * 50, GREEDY.with_seed(), Reply()))
    for _ in range(100):
        if not lanes.step():
            break
    assert lanes.idle and lanes.census()
    sent = [s for op in wire.ops if op[0] == "run" for s in op[1] if s.embeds]
    assert sent and all(v.device.type == "cpu" for s in sent for _, v in s.embeds)
    Follower(rank(follow), wire).loop()
    assert lead.encoded == 1 and follow.encoded == 0
    assert len(lead.placed) == len(follow.placed) == 2  # [10, 32) and [32, 40)
    for ours, theirs in zip(lead.placed, follow.placed):
        assert torch.equal(ours, theirs)
