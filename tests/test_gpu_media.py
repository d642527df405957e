"""Media pieces through the engine on the GPU (`pytest -m gpu`): lfm2_moe's demo in bf16 on
CUDA, wrapped with a tower as tests/test_media_engine.py wraps it, on a GraphRunner (decode
rounds replayed as CUDA graphs, sent ahead): concurrent == solo with images among text,
resumed == fresh with an image in the kept prefix, and a one-row prompt chunk that holds an
image's last row runs eagerly (a decode graph would drop its media row), so how the prompt is
cut never changes the tokens. Every engine's census is even when it stops."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
from test_media_engine import (
    GREEDY,
    PROMPTS,
    SAMPLED,
    Pictured,
    alone,
    assert_even,
    open_engine,
    prompt,
    submit,
    wait,
)

from tensorfold.engine.engine import Engine
from tensorfold.family.checkpoint import Checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def inner(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tensorfold_lfm2_moe.demo import build_demo
    from tensorfold_lfm2_moe.model import load

    folder = build_demo(tmp_path_factory.mktemp("gpu-media-demo"))
    return load(Checkpoint.open(Path(folder)), "cuda", "bfloat16")


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    opened: list[Engine] = []
    yield opened
    for engine in opened:
        engine.stop(timeout=120)
        assert_even(engine)


def graphed(model: Any, **kw: Any) -> Engine:
    from tensorfold.engine.cuda_graphs import GraphRunner

    return open_engine(model, runner_cls=GraphRunner, **kw)


def test_concurrent_equals_solo_with_images_on_the_gpu(inner: Any, engines: list[Engine]):
    engines.append(engine := graphed(Pictured(inner)))
    for params in (GREEDY, SAMPLED):
        solo = [alone(engine, p, params).tokens for p in PROMPTS]
        together = [submit(engine, p, params) for p in PROMPTS]
        wait(together)
        assert [r.tokens for r in together] == solo


def test_resumed_equals_fresh_with_an_image_on_the_gpu(inner: Any, engines: list[Engine]):
    engines.append(kept := graphed(Pictured(inner), share=16))
    engines.append(fresh := graphed(Pictured(inner)))
    ids, pieces = prompt(7, [13, (24, 107, True), 6])
    first = alone(kept, (ids, pieces), SAMPLED)
    turn = ids + first.tokens + prompt(8, [9])[0]
    resumed = alone(kept, (turn, pieces), SAMPLED)
    assert resumed.finished is not None and resumed.finished.cached_tokens > pieces[0].end
    assert resumed.tokens == alone(fresh, (turn, pieces), SAMPLED).tokens


def test_a_one_row_chunk_with_an_image_row_is_not_a_decode_graph(inner: Any, engines: list[Engine]):
    """A 33-row prompt whose image ends it: at 32-row passes its last chunk is the image's last
    row alone, shaped like a decode row; its tokens equal one 64-row pass's."""
    p = prompt(16, [20, (13, 116, False)])  # rows [20, 33)
    engines.append(cut := graphed(Pictured(inner), pass_rows=32))
    engines.append(whole := graphed(Pictured(inner), pass_rows=64))
    for params in (GREEDY, SAMPLED):
        assert alone(cut, p, params).tokens == alone(whole, p, params).tokens
