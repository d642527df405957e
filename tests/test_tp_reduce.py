"""The small-message sum over ranks (core/ops/symmetric_reduce.py) on the CPU:

- its kernel (ops/triton_rank_sum.py) under TRITON_INTERPRET=1 against the NCCL path's torch sum
  (parallel.rank_order_sum), bit for bit, for 1 to 8 ranks, bf16 and fp32 in and out;
- its protocol: every write, barrier and read a sequence of eager passes and replayed CUDA
  graphs would run, checked for the race (a slot written while a peer may still read it) and
  for reads that could see another call's values; the check finds the race when the pass fence
  is left out;
- which messages it takes (the size bound), the runners' pass fence, TF_TP_REDUCE's values.
The real thing on two GPUs: tests/test_gpu_tp_reduce.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tensorfold import testing
from tensorfold.config.settings import Settings, SettingsError
from tensorfold.engine.runner import ModelRunner, open_stream
from tensorfold.ops import parallel
from tensorfold.ops.symmetric_reduce import SLOT_BYTES, SLOTS, OneShot, multicast_on

# -- the kernel -------------------------------------------------------------------------------

CASES = [
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
]


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("dtypes", CASES, ids=lambda d: f"{d[0]}->{d[1]}".replace("torch.", ""))
def test_rank_sum_kernel_equals_the_rank_order_sum_bit_for_bit(world, dtypes):
    pytest.importorskip("triton")
    from tensorfold.ops.triton_rank_sum import rank_sum

    dtype, out_dtype = dtypes
    g = torch.Generator().manual_seed(world)
    # magnitudes far apart, so that the order of the adds shows in the rounding
    parts = (
        torch.randn(world, 3, 700, generator=g) * torch.logspace(-3, 3, world)[:, None, None]
    ).to(dtype)
    want = parallel.rank_order_sum(parts, out_dtype)
    flat = [p.reshape(-1) for p in parts]
    with testing.interpreter_rounds_like_the_gpu():
        got = rank_sum(flat, torch.empty(3, 700, dtype=out_dtype))
        row = rank_sum([f[700:1400] for f in flat], torch.empty(700, dtype=out_dtype))
    assert torch.equal(
        got.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32),
        want.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32),
    )
    assert torch.equal(row, want[1])  # a row alone: the same bits as among the others
    if world > 2 and dtypes == (torch.float32, torch.float32):  # (two adds commute exactly)
        reversed_order = parallel.rank_order_sum(parts.flip(0), out_dtype)
        assert not torch.equal(reversed_order, want)  # the order is what the test pins


def test_multicast_is_read_off_the_handle_whatever_torch_offers():
    """torch 2.11's handles carry has_multicast_support as a static check that takes a device
    (calling it bare raised a TypeError on two H200s); multicast_ptr says it for the handle."""

    class Torch211:
        multicast_ptr = 0

        @staticmethod
        def has_multicast_support(device_type, device_index):
            return True

    class Multicast:
        multicast_ptr = 0x7F0000000000

    assert not multicast_on(Torch211())
    assert multicast_on(Multicast())
    assert not multicast_on(object())


def test_rank_sum_takes_at_most_eight_ranks():
    pytest.importorskip("triton")
    from tensorfold.ops.triton_rank_sum import rank_sum

    with pytest.raises(ValueError, match="1 to 8 parts"):
        rank_sum([torch.zeros(4)] * 9, torch.empty(4))


# -- the protocol -----------------------------------------------------------------------------


class Trace(OneShot):
    """A OneShot whose steps are recorded, not run: ("write", slot, call), ("barrier",),
    ("read", slot, call), into `into` (the stream, or a graph being captured)."""

    def __init__(self, slot_bytes: int = SLOT_BYTES):
        super().__init__(0, 2, slot_bytes)
        self.into: list[tuple] = []
        self.call = 0

    def takes(self, x, dtype):  # CPU tensors stand in: the protocol does not look at the data
        return self.fits(x.numel() * x.element_size(), x.dtype, dtype)

    def _write(self, slot, x):
        self.call += 1
        self.into.append(("write", slot, self.call))

    def _barrier(self):
        self.into.append(("barrier",))

    def _read_sum(self, slot, x, dtype):
        self.into.append(("read", slot, self.call))
        return x.to(dtype)


def races(stream: list[tuple]) -> list[str]:
    """Every rank runs `stream` (the same passes, in order); a rank passes a barrier only once
    every rank has reached it. So a write of slot s is safe when a barrier lies between it and
    every earlier read of s, and a read sees its own call's values when the last write of s
    before it is its call's, with a barrier between them."""
    found = []
    last_read: dict[int, int] = {}
    last_write: dict[int, tuple[int, int]] = {}
    last_barrier = -1
    for i, op in enumerate(stream):
        if op[0] == "barrier":
            last_barrier = i
        elif op[0] == "write":
            s = op[1]
            if last_read.get(s, -1) > last_barrier:
                found.append(
                    f"op {i}: slot {s} written while a peer may read it (op {last_read[s]})"
                )
            last_write[s] = (i, op[2])
        else:
            s = op[1]
            at, call = last_write.get(s, (-1, None))
            if call != op[2] or at > last_barrier:
                found.append(f"op {i}: the read of slot {s} may not see its call's values")
            last_read[s] = i
    return found


def run_pass(calls: int) -> None:
    parallel.begin_pass()
    for _ in range(calls):
        parallel.sum_partials(torch.zeros(2))


@pytest.fixture
def traced():
    """A Trace as the reduce of a world-2 group."""
    reduce = Trace()
    old = parallel.current()
    parallel.set_group(parallel.Group(0, 2, None, reduce))
    yield reduce
    parallel.set_group(old)


def graph_scenario(reduce: Trace) -> list[tuple]:
    """Eager passes of 3 and 2 calls, a graph of 3 calls captured after warm-ups and replayed
    between eager passes of 1 and 4 calls (the sequence a server runs: prefill passes eager,
    decode rounds replayed)."""
    stream: list[tuple] = []
    reduce.into = stream
    run_pass(3)
    run_pass(2)
    graph: list[tuple] = []
    reduce.into = graph
    run_pass(3)  # the capture: recorded, not run
    reduce.into = stream
    for eager in (1, 4, 0, 3):
        stream += graph
        run_pass(eager)
        stream += graph
        stream += graph
    return stream


def test_passes_and_replayed_graphs_never_race(traced):
    stream = graph_scenario(traced)
    assert sum(op[0] == "read" for op in stream) == 3 + 2 + 3 * 12 + 8
    assert races(stream) == []
    assert {op[1] for op in stream if op[0] == "write"} == set(range(SLOTS))


def test_the_check_finds_the_race_without_the_pass_fence(traced, monkeypatch):
    monkeypatch.setattr(traced, "begin_pass", lambda: setattr(traced, "calls", 0))
    assert races(graph_scenario(traced))


def test_one_slot_would_race_within_a_pass(traced, monkeypatch):
    import tensorfold.ops.symmetric_reduce as sr

    monkeypatch.setattr(sr, "SLOTS", 1)
    stream: list[tuple] = []
    traced.into = stream
    run_pass(2)
    assert races(stream)


def test_the_runners_fence_every_pass(traced):
    from test_tensor_parallel import CountModel

    runner = ModelRunner(CountModel(), num_pages=4, num_slots=1, page_rows=16)
    stream = open_stream(runner, 0, 32)
    traced.into = []
    runner.run([stream.rows([3, 4, 5])])
    runner.run([stream.rows([6])])
    assert traced.into == [("barrier",), ("barrier",)]


# -- the buffers, with every rank's memory in this process -------------------------------------


class FakeHandle:
    """What SymmetricReduce uses of torch's handle, over CPU tensors: every rank's allocation
    (`bases`), its buffer at the same offset in each, as torch's implicit pool places it."""

    def __init__(self, bases: list[torch.Tensor]):
        self.bases = bases
        self.buffer_ptrs = [b.data_ptr() for b in bases]

    def get_buffer(self, rank, sizes, dtype, storage_offset=0):
        flat = self.bases[rank].view(dtype)
        n = int(torch.tensor(sizes).prod())
        return flat[storage_offset : storage_offset + n].view(sizes)


@pytest.mark.parametrize("offset", [0, 4096])
def test_each_rank_reads_every_ranks_slot_in_rank_order(offset):
    pytest.importorskip("triton")
    from tensorfold.ops.symmetric_reduce import SymmetricReduce

    world, slot_bytes = 3, 4096
    bases = [
        torch.zeros(offset + SLOTS * slot_bytes + 512, dtype=torch.uint8) for _ in range(world)
    ]
    handle = FakeHandle(bases)
    ranks = [
        SymmetricReduce(
            handle,
            bases[r][offset : offset + SLOTS * slot_bytes],
            r,
            world,
            slot_bytes,
            timeout_ms=1,
        )
        for r in range(world)
    ]
    g = torch.Generator().manual_seed(3)
    written = []
    for slot, (dtype, out_dtype, rows) in enumerate(
        [(torch.bfloat16, torch.bfloat16, 7), (torch.float32, torch.bfloat16, 4)]
    ):
        parts = (torch.randn(world, rows, 64, generator=g) * 100).to(dtype)
        written.append(parts)
        for r in range(world):
            ranks[r]._write(slot, parts[r])
        want = parallel.rank_order_sum(parts, out_dtype)
        with testing.interpreter_rounds_like_the_gpu():
            for r in range(world):
                assert torch.equal(ranks[r]._read_sum(slot, parts[r], out_dtype), want)
    # slot 1's writes left slot 0's values where they were, and rank 0 sees each rank's own
    for r in range(world):
        assert torch.equal(
            ranks[0].views(0, torch.bfloat16)[r][: 7 * 64].view(7, 64), written[0][r]
        )
    assert all(b[:offset].eq(0).all() for b in bases)  # nothing written before the buffers


# -- what it takes ----------------------------------------------------------------------------


def test_messages_up_to_the_bound_take_the_symmetric_path():
    reduce = OneShot(0, 2, slot_bytes=1024)
    assert reduce.fits(1024, torch.float32, torch.bfloat16)
    assert not reduce.fits(1028, torch.float32, torch.bfloat16)
    assert reduce.fits(1024, torch.bfloat16, torch.float32)
    assert not reduce.fits(8, torch.float64, torch.float64)
    # the bound holds a 256-stream decode round of gemma4's widest partial (2 x 2816 fp32)
    assert OneShot(0, 2).fits(256 * 2 * 2816 * 4, torch.float32, torch.float32)
    assert not OneShot(0, 2).takes(torch.zeros(4), torch.float32)  # on the CPU: gloo's path


# -- set up at join ---------------------------------------------------------------------------


class JoinedStub:
    """What Joined._small_reduce reads of a rank: its place, its timeout, the control group's
    gather (here: every rank's answer, as `failing` makes them)."""

    def __init__(self, rank: int, failing: tuple[int, ...]):
        self.rank, self.world, self.local_rank, self.timeout_s = rank, 2, rank, 5.0
        self.failing = failing

    def gather(self, why):
        return [
            why
            if r == self.rank
            else ("RuntimeError: no peer access" if r in self.failing else None)
            for r in range(self.world)
        ]


@pytest.mark.parametrize("failing", [(), (1,), (0, 1)])
def test_every_rank_takes_nccl_when_any_rank_cannot_set_up(monkeypatch, failing):
    import tensorfold.ops.symmetric_reduce as sr
    from tensorfold.engine.tensor_parallel import Joined

    def open_symmetric(group, rank, world, device, timeout_s):
        if rank in failing:
            raise RuntimeError("no peer access")
        return ("reduce of rank", rank)

    monkeypatch.setattr(sr, "open_symmetric", open_symmetric)
    got = [Joined._small_reduce(JoinedStub(r, failing), Settings()) for r in range(2)]
    assert got == ([("reduce of rank", 0), ("reduce of rank", 1)] if not failing else [None] * 2)
    nccl = Settings(tp_reduce="nccl")
    assert [Joined._small_reduce(JoinedStub(r, ()), nccl) for r in range(2)] == [None, None]


# -- the setting ------------------------------------------------------------------------------


def test_tp_reduce_setting(tf_env):
    assert Settings().tp_reduce == "symmetric"
    tf_env.setenv("TF_TP_REDUCE", "nccl")
    assert Settings().tp_reduce == "nccl"
    tf_env.setenv("TF_TP_REDUCE", "allreduce")
    with pytest.raises(SettingsError) as err:
        Settings()
    assert str(err.value) == (
        "TF_TP_REDUCE=allreduce is not valid; accepted values: symmetric, nccl"
    )
