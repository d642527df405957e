"""Tensor parallel's core pieces: how tensors are cut and read, the per-rank plan, the
collectives (in two gloo processes), and rank 0's operations repeated on a follower's storage
(in one process, through a recorded channel)."""

from __future__ import annotations

import pickle
import socket
import threading
from collections import deque
from pathlib import Path

import pytest
import torch

from tensorfold.adapters.snapshots import SnapshotArena
from tensorfold.config.settings import Settings, SettingsError
from tensorfold.engine import lanes as lanes_module
from tensorfold.engine.lanes import Lanes
from tensorfold.engine.requests import Finished, Request
from tensorfold.engine.runner import ModelRunner
from tensorfold.engine.sampling import SamplingParams
from tensorfold.engine.start import open_sharing, parallel_launch, plan_memory
from tensorfold.engine.tensor_parallel import Follower, Leader, MirrorArena, Team
from tensorfold.family import (
    ROW,
    ModelShape,
    RowSpec,
    Shard,
    ShardPlan,
    ShardRefused,
    Split,
    StateLayout,
    StateSpec,
    block,
)
from tensorfold.family.checkpoint import Checkpoint, CheckpointError
from tensorfold.family.forward_pass import ForwardPass
from tensorfold.family.model import FamilyModel
from tensorfold.family.plugins import family_plugin_manager
from tensorfold.memory.kv_plan import PlanRefused
from tensorfold.ops import parallel
from tensorfold.ops.linear import linear
from tensorfold.ops.moe import moe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- cutting and reading ------------------------------------------------------------------------


def test_blocks_heads_and_sections():
    assert [block(8, r, 2) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [block(2, r, 4) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    with pytest.raises(ShardRefused):
        block(3, 0, 2)
    # [3H, H] with sections B, C, x: a rank takes its channels of each, in order
    assert Split(dim=0, groups=3).pieces(12, 1, 2) == [(2, 4), (6, 8), (10, 12)]
    # 2 KV heads of 4 rows at 4 ranks: ranks 0, 1 read head 0; ranks 2, 3 head 1
    kv = Split(dim=0, parts=2)
    assert [kv.pieces(8, r, 4) for r in range(4)] == [[(0, 4)], [(0, 4)], [(4, 8)], [(4, 8)]]
    with pytest.raises(ShardRefused):
        Shard(0, 4).experts(6)


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    save_file(
        {
            "q.weight": torch.randn(8, 6, generator=g),
            "o.weight": torch.randn(6, 8, generator=g),
            "in_proj.weight": torch.randn(12, 6, generator=g),
            "norm.weight": torch.randn(6, generator=g),
            "experts.0.w": torch.randn(3, 6, generator=g),
            "experts.1.w": torch.randn(3, 6, generator=g),
        },
        str(tmp_path / "model.safetensors"),
    )
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


PLAN = ShardPlan(
    (
        (r"q\.weight", Split(dim=0, parts=4)),
        (r"o\.weight", ROW),
        (r"in_proj\.weight", Split(dim=0, groups=3)),
        (r"experts\.(?P<expert>\d+)\.w", Split(experts=2)),
    ),
    StateLayout(),
)


def test_each_rank_reads_its_slice(shards: Path):
    whole = Checkpoint.open(shards)
    full = {n: whole.load(n) for n in whole.tensor_names()}
    read = 0
    for rank in range(2):
        ckpt = Checkpoint.open(shards)
        ckpt.set_shard(Shard(rank, 2, PLAN))
        a, b = rank * 4, rank * 4 + 4
        assert torch.equal(ckpt.load("q.weight", shape=(8, 6)), full["q.weight"][a:b])
        assert torch.equal(ckpt.load("o.weight"), full["o.weight"][:, rank * 4 : rank * 4 + 4])
        sections = full["in_proj.weight"].view(3, 4, 6)[:, rank * 2 : rank * 2 + 2].reshape(6, 6)
        assert torch.equal(ckpt.load("in_proj.weight"), sections)
        assert torch.equal(ckpt.load("norm.weight"), full["norm.weight"])
        assert torch.equal(ckpt.load(f"experts.{rank}.w"), full[f"experts.{rank}.w"])
        with pytest.raises(CheckpointError, match="another rank's experts"):
            ckpt.load(f"experts.{1 - rank}.w")
        assert ckpt.local_shape(f"experts.{1 - rank}.w") is None
        read += ckpt.local_bytes()
    # the norm is read by both ranks, everything else once
    assert read == whole.total_bytes() + full["norm.weight"].numel() * 4


def test_a_tensor_that_cannot_be_cut_is_refused_before_any_load(shards: Path):
    ckpt = Checkpoint.open(shards)
    bad = ShardPlan(((r"norm\.weight", Split(dim=0, parts=3)),), StateLayout())
    with pytest.raises(ShardRefused, match="'norm.weight'.*--tp 2"):
        ckpt.set_shard(Shard(0, 2, bad))


def test_tp_for_a_family_without_a_shard_plan_is_refused_before_a_follower_starts(
    tf_env: pytest.MonkeyPatch, pm, tmp_path: Path
) -> None:
    """--tp 2 of a family whose hooks answer no shard_plan: refused from config.json alone,
    before rank 0 opens its store or starts ranks 1.. (nothing to stop afterwards)."""
    import fake_family

    from tensorfold.engine import start, tensor_parallel
    from tensorfold.family.plugins import FamilyError

    tf_env.syspath_prepend(str(Path(__file__).parent))  # spec.hooks: "fake_family:hooks_a"
    pm.add_plugin(fake_family.FamiliesPlugin("a"), "fake")
    tf_env.setattr(start, "get_plugin_manager", lambda settings=None: pm)
    (tmp_path / "config.json").write_text("{}")

    def started(*args: object, **kw: object) -> None:
        raise AssertionError("a follower started before the refusal")

    tf_env.setattr(tensor_parallel.subprocess, "Popen", started)
    tf_env.setattr(tensor_parallel.dist, "TCPStore", started)
    with pytest.raises(FamilyError, match="'a'.*declares no tensor parallel.*drop --tp"):
        start.open_served(Settings().with_overrides(tp=2, device="cpu"), "a", tmp_path)


# -- the plan, per rank -------------------------------------------------------------------------


class _Rooms:
    """A group stand-in for plan_memory: every rank's room, as gather would give them."""

    world = 2

    def __init__(self, limits_gib: list[float]):
        self.limits = limits_gib

    def gather(self, room: int) -> list[int]:
        return [int(g * (1 << 30)) for g in self.limits]


SHAPE = ModelShape(
    StateLayout(paged=(RowSpec("k", (2, 64)),), fixed=(StateSpec("s", (64,)),)), 1 << 20
)


def test_the_plan_is_per_rank_and_a_refusal_names_the_short_rank():
    settings = Settings(parallel=2, context=65536, prompt_cache_gib=0)
    plan = plan_memory(settings, SHAPE, "cpu", 0, _Rooms([1.0, 1.0]))
    assert plan.ranks == 2 and plan.startup_line().startswith("kv plan per rank (tp 2): 2 streams")
    with pytest.raises(PlanRefused, match=r"^rank 1 of --tp 2 is short: --parallel 2 needs"):
        plan_memory(settings, SHAPE, "cpu", 0, _Rooms([1.0, 0.02]))
    assert plan_memory(settings, SHAPE, "cpu", 0).startup_line().startswith("kv plan: ")


def test_who_takes_part(monkeypatch: pytest.MonkeyPatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert parallel_launch(Settings()) is None  # one rank: no group, no broadcasts
    launch = parallel_launch(Settings(tp=2))
    assert (launch.rank, launch.world, launch.spawned) == (0, 2, True)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert parallel_launch(Settings()) is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    launch = parallel_launch(Settings())
    assert (launch.rank, launch.world, launch.spawned) == (1, 2, False)
    with pytest.raises(SettingsError, match="--tp 4 disagrees with torchrun's WORLD_SIZE=2"):
        parallel_launch(Settings(tp=4))


# -- the collectives, in two gloo processes -----------------------------------------------------


def test_collectives_are_the_identity_at_one_rank():
    x = torch.randn(5, 8)
    w, b = torch.randn(6, 8), torch.randn(6)
    assert parallel.sum_partials(x) is x and parallel.gather_columns(x) is x
    assert torch.equal(parallel.row_linear(x, w, b), linear(x, w, b))


def _collectives(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    parallel.set_group(parallel.Group(rank, 2))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 16, generator=g)
    w1, w3 = torch.randn(4, 8, 16, generator=g), torch.randn(4, 8, 16, generator=g)
    w2 = torch.randn(4, 16, 8, generator=g)
    weights, experts = torch.rand(7, 2, generator=g), torch.randint(0, 4, (7, 2), generator=g)
    lm = torch.randn(10, 16, generator=g)
    mine = slice(2 * rank, 2 * rank + 2)
    got = {
        "sum": parallel.sum_partials(torch.full((3, 4), 0.1 * (rank + 1))),
        "cols": parallel.gather_columns(linear(x, lm[5 * rank : 5 * rank + 5])),
        "row": parallel.row_linear(
            x[:, 8 * rank : 8 * rank + 8], lm[:, 8 * rank : 8 * rank + 8], torch.ones(10)
        ),
        "moe": parallel.expert_parallel_moe(
            x, weights, experts, w1[mine], w3[mine], w2[mine], 2 * rank
        ),
        "alone": moe(x, weights, experts, w1, w3, w2),
        "logits": linear(x, lm),
        # each rank's slice computed here: a gather moves bits, so it must equal these side by side
        # (not linear(x, lm): a BLAS may sum a column of a 10-wide product in another order)
        "slices": torch.cat([linear(x, lm[5 * r : 5 * r + 5]) for r in range(2)], -1),
        "row_alone": linear(x, lm, torch.ones(10)),
    }
    if rank == 0:
        torch.save(got, out)
    dist.destroy_process_group()


def test_sums_gathers_and_experts_across_two_ranks(tmp_path: Path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "got.pt")
    mp.spawn(_collectives, args=(free_port(), out), nprocs=2)
    got = torch.load(out)
    # rank order in fp32: 0.1 + 0.2, rounded once
    assert torch.equal(got["sum"], torch.full((3, 4), 0.1) + torch.full((3, 4), 0.2))
    assert torch.equal(got["cols"], got["slices"])  # moves bits only
    torch.testing.assert_close(got["cols"], got["logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["row"], got["row_alone"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["moe"], got["alone"], rtol=1e-5, atol=1e-5)


# -- rank 0's operations, repeated on a follower's storage --------------------------------------


class CountModel(FamilyModel):
    """A model with paged rows and fixed state and no weights: a row's K is (token, position),
    the state a running sum of tokens (tapped at marks), the logits a function of both."""

    name = "count"
    vocab_size = 16
    max_positions = 4096
    layout = StateLayout(paged=(RowSpec("k", (2,)),), fixed=(StateSpec("s", (3,)),))
    device = torch.device("cpu")
    dtype = torch.float32

    def forward(self, fp: ForwardPass, rows, slots) -> torch.Tensor:
        tok = fp.tokens.float()
        rows.write("k", fp.write_index, torch.stack((tok, fp.positions.float()), 1))
        state = slots.get("s")
        outs = []
        for i, (s, (lo, hi)) in enumerate(zip(fp.streams, fp.spans)):
            st = torch.zeros(3) if s.start == 0 else state[s.slot].clone()
            keys = rows.flat("k").index_select(0, fp.read_index(i))[:, 0]
            for j, p in enumerate(range(s.start, s.end)):
                if p in s.taps:
                    fp.tap(i, p, "s", st.clone())
                st = st + torch.tensor([tok[lo + j], 1.0, keys[: p + 1].sum()])
                outs.append(st)
            if s.end in s.taps:
                fp.tap(i, s.end, "s", st.clone())
            state[s.slot] = st
        h = torch.stack(outs).index_select(0, fp.logit_rows)
        return (h[:, :1] * torch.arange(16.0) % 7.0 + h[:, 1:2] * 0.01).float()


class Wire:
    """A Joined stand-in: what rank 0 sends is what the follower receives (pickled on the way)."""

    timeout_s = 5.0
    world = 2

    def __init__(self):
        self.ops: deque = deque()
        self.lock = threading.Lock()
        self.broken = None
        self.last_sent = 0.0

    def send(self, op):
        self.ops.append(pickle.loads(pickle.dumps(op)))

    def receive(self):
        return self.ops.popleft() if self.ops else ("stop",)


def _rank(arena_cls, poison: bool):
    from tensorfold.adapters import paged_kv, snapshots
    from tensorfold.engine.start import Rank
    from tensorfold.family import FamilySpec

    hooks = family_plugin_manager(FamilySpec("count", "x:y", "x:y"), [paged_kv, snapshots])
    runner = ModelRunner(
        CountModel(), num_pages=16, num_slots=2, page_rows=16, poison=poison, plugin_manager=hooks
    )
    arena = arena_cls(CountModel.layout.fixed, 6)
    for buf in [*runner.rows.buffers.values(), *arena.buffers.values()]:
        buf.zero_()  # allocated empty: rows never written must not differ by chance
    return Rank(None, None, runner, hooks.hook, arena, 6)


def test_a_follower_repeats_rank_0s_operations_on_its_storage(monkeypatch):
    """Chats through the lanes with the prompt store on and poison on: passes, taps and keeps,
    resumes (a partial page copied, a snapshot restored), eviction and freed pages and slots:
    the follower's storage ends equal to rank 0's."""
    wire = Wire()
    lead, follow = _rank(SnapshotArena, True), _rank(MirrorArena, True)
    runner = Leader(lead.runner, Team(wire))
    sharing = open_sharing(
        type("P", (), {"cache_bytes": 8 * 32, "page_bytes": 32, "pass_rows": 32})(),
        runner,
        lead.hooks,
        lead.arena,
        6,
        CountModel.layout,
    )
    monkeypatch.setattr(lanes_module, "DECODE_AHEAD", True)
    lanes = Lanes(runner, lanes=2, window=256, pass_rows=32, sharing=sharing)
    assert not lanes.ahead  # rounds are not sent ahead: the followers could not read the draws
    done = []
    g = torch.Generator().manual_seed(0)
    base = [torch.randint(1, 16, (40,), generator=g).tolist() for _ in range(2)]
    for turn in range(3):
        for chat in range(2):
            prompt = base[chat] + [3 + turn] * (5 * turn)
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True).with_seed()
            lanes.add(Request(prompt, params, done.append, marks=(len(base[chat]),)))
        while lanes.step():
            pass
    # n = 2 choices of one prompt: the second forks from the first (attach, copy_slot)
    sampled = SamplingParams(temperature=0.9, seed=5, max_tokens=4, ignore_eos=True)
    forked = Request(base[1] + [7] * 3, sampled, done.append)
    forked.forks = [
        Request(forked.prompt, SamplingParams(**{**vars(sampled), "seed": 6}), done.append)
    ]
    lanes.add(forked)
    while lanes.step():
        pass
    assert sum(isinstance(e, Finished) and e.cached_tokens > 0 for e in done) >= 2
    kinds = {op[0] for op in wire.ops}
    assert {"run", "keep", "restore", "attach", "poison_pages", "poison_slot", "copy_slot"} <= kinds
    Follower(follow, wire).loop()
    for name, buf in lead.runner.rows.buffers.items():
        torch.testing.assert_close(
            follow.runner.rows.buffers[name], buf, equal_nan=True, rtol=0, atol=0
        )
    for name, buf in lead.runner.slots.buffers.items():
        torch.testing.assert_close(
            follow.runner.slots.buffers[name], buf, equal_nan=True, rtol=0, atol=0
        )
    for kept in sharing.store.kept():
        page = kept.snapshot.page
        assert torch.equal(follow.arena.buffers["s"][page], lead.arena.buffers["s"][page])
