"""A pass on the CPU runs on one torch thread (core/engine/cpu_threads.py says why), and the caller's
thread count comes back after it, also when the forward raises."""

from __future__ import annotations

import pytest
import torch
from test_tensor_parallel import CountModel

from tensorfold.engine.runner import ModelRunner
from tensorfold.family.forward_pass import StreamRows


class ThreadsSeen(CountModel):
    def __init__(self, fail: bool = False):
        super().__init__()
        self.seen: list[int] = []
        self.fail = fail

    def forward(self, fp, rows, slots):
        self.seen.append(torch.get_num_threads())
        if self.fail:
            raise RuntimeError("a forward that fails")
        return super().forward(fp, rows, slots)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_cpu_pass_runs_on_one_thread_and_gives_the_threads_back(two_threads):
    model = ThreadsSeen()
    runner = ModelRunner(model, num_pages=4, num_slots=1, page_rows=16)
    runner.run([StreamRows(0, 0, [1, 2, 3], [0], "all")])
    assert model.seen == [1] and torch.get_num_threads() == 2
    failing = ModelRunner(ThreadsSeen(fail=True), num_pages=4, num_slots=1, page_rows=16)
    with pytest.raises(RuntimeError, match="fails"):
        failing.run([StreamRows(0, 0, [1, 2, 3], [0], "all")])
    assert torch.get_num_threads() == 2
