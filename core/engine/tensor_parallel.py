"""Tensor and expert parallel over torch.distributed: one rank a device (gloo on the CPU, NCCL
on CUDA; the same code).

Rank 0 owns the server, the lanes, the pool's accounting and the prompt store. Every rank holds
the same page, slot and snapshot storage (its shard's widths) and runs the same passes on its
shard of the weights; the forward's collectives live in `tensorfold.ops.parallel`. Rank 0's
runner (`Leader`) sends each operation that touches that storage to the other ranks as one
object broadcast, over a gloo group of its own, and does it itself; the followers
(`Follower.loop`) receive and repeat them in the same order:

    ("run", streams)                        a pass: every rank's forward meets in the same
                                            collectives, in the same order; its media rows
                                            (rank 0 alone runs the tower) on the CPU
    ("poison_pages", pages)                 freed pages NaN-filled (TF_KV_POISON)
    ("poison_slot", slot)                   a freed slot NaN-filled (TF_KV_POISON)
    ("attach", kept_pages, kept_rows, table) a resume's share_attach, with rank 0's page table
    ("keep", slot, tap, page)               a snap_keep into snapshot page `page`
    ("restore", page, slot)                 a snap_restore from snapshot page `page`
    ("rewind", slot, tap)                   a verify round's slot back to the state tapped
    ("beat",)                               nothing: keeps an idle follower inside the timeout
    ("stop",)                               the follower leaves

Started by `--tp N` (rank 0 runs `python -m tensorfold.engine.tp_follower` for ranks 1..N-1 and
watches them) or by torchrun (every rank runs the same command; ranks above 0 follow). A
follower that dies or stalls past TF_TP_TIMEOUT_S stops rank 0's engine with an error naming
it (`TensorParallelError`), never a silent stall.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from tensorfold.adapters.snapshots import Snapshot, SnapshotArena

from ..config.logs import get_logger
from ..config.settings import Settings
from ..family import FamilySpec
from ..ops import parallel

log = get_logger("tensorfold.tensor_parallel")

JOINED_KEY = "tensorfold/joined/{}"
START_TIMEOUT_S = 3600.0  # ranks loading their shards wait this long for each other
LEAVE_WAIT_S = 30.0  # how long a rank waits for NCCL's teardown when it leaves


class TensorParallelError(RuntimeError):
    """A rank was lost (exited, or did not answer within TF_TP_TIMEOUT_S): the engine stops."""

    fatal = True


@dataclass(frozen=True)
class Launch:
    """This process's place: rank of world, its device index, where rank 0's store listens
    (port 0 with spawned=True: rank 0 picks one and starts the other ranks itself)."""

    rank: int
    world: int
    local_rank: int
    addr: str
    port: int
    spawned: bool


class Joined:
    """A rank in the process group: the forward's collectives (the default group) and the
    control group that carries the operations (gloo, also beside NCCL)."""

    def __init__(self, launch: Launch, settings: Settings, store: Any = None):
        self.rank, self.world, self.local_rank = launch.rank, launch.world, launch.local_rank
        self.timeout_s = settings.tp_timeout_s
        timeout = timedelta(seconds=self.timeout_s)
        auto = settings.device == "auto"
        cuda = settings.device == "cuda" or (auto and torch.cuda.is_available())
        backend = self.backend = "nccl" if cuda else "gloo"
        if cuda:
            torch.cuda.set_device(self.local_rank)
        self.threads = torch.get_num_threads()
        if not cuda:  # the host's cores shared out: ranks spinning on each other's cores crawl
            torch.set_num_threads(max(1, self.threads // self.world))
        if store is not None:
            dist.init_process_group(
                backend, store=store, rank=self.rank, world_size=self.world, timeout=timeout
            )
        else:
            dist.init_process_group(
                backend,
                init_method="env://",
                rank=self.rank,
                world_size=self.world,
                timeout=timeout,
            )
        # The operations' own group: start-up waits on it while ranks load their weights (up
        # to START_TIMEOUT_S); once serving, rank 0's beats keep an idle follower inside it.
        self.control = dist.new_group(
            backend="gloo", timeout=timedelta(seconds=max(self.timeout_s, START_TIMEOUT_S))
        )
        reduce = self._small_reduce(settings) if cuda else None
        parallel.set_group(parallel.Group(self.rank, self.world, None, reduce))
        self.lock = threading.Lock()  # one operation at a time: its broadcast and its work
        self.broken: str | None = None
        self.last_sent = time.monotonic()

    def _small_reduce(self, settings: Settings) -> Any:
        """The one-shot sum over symmetric memory for small partials (TF_TP_REDUCE=symmetric),
        when every rank set it up; else None: NCCL's all_gather, said once with why."""
        from ..ops.symmetric_reduce import SLOT_BYTES, open_symmetric

        if settings.tp_reduce == "nccl":
            if self.rank == 0:
                log.info(
                    "tensor parallel: partial sums through NCCL's all_gather (TF_TP_REDUCE=nccl)"
                )
            return None
        reduce, why = None, None
        try:
            reduce = open_symmetric(
                dist.group.WORLD,
                self.rank,
                self.world,
                torch.device("cuda", self.local_rank),
                self.timeout_s,
            )
        except Exception as exc:  # this torch, driver or machine cannot: NCCL serves
            why = f"{type(exc).__name__}: {exc}"
        failed = [f"rank {r}: {w}" for r, w in enumerate(self.gather(why)) if w]
        if failed:  # every rank takes the same path
            if self.rank == 0:
                log.warning(
                    "tensor parallel: partial sums through NCCL's all_gather; symmetric "
                    "memory could not be set up (" + "; ".join(failed) + ")"
                )
            return None
        if self.rank == 0:
            log.info(
                f"tensor parallel: partial sums up to {SLOT_BYTES >> 20} MiB through "
                "symmetric memory (one kernel, rank order in fp32), larger through NCCL"
            )
        return reduce

    def device(self, picked: str) -> str:
        """This rank's device: its own GPU (LOCAL_RANK) on CUDA."""
        return f"cuda:{self.local_rank}" if picked.startswith("cuda") else picked

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (start-up only)."""
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def send(self, op: tuple) -> None:
        """Rank 0: broadcast one operation (the caller holds `lock`)."""
        dist.broadcast_object_list([op], src=0, group=self.control)
        self.last_sent = time.monotonic()

    def receive(self) -> tuple:
        """A follower: the next operation rank 0 sent."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def leave(self, wait_s: float = LEAVE_WAIT_S) -> None:
        """Leave the group. After a lost rank NCCL's teardown could wait on it: the process
        keeps its group then (it is about to exit); gloo's is local. NCCL's teardown waits for
        its peers' (every rank leaves at once: rank 0 right after its stop, a follower when it
        receives it); it runs in a thread given wait_s, so a peer that never tears down costs a
        warning, not a hang."""
        parallel.set_group(None)
        torch.set_num_threads(self.threads)
        if not dist.is_initialized() or (self.broken is not None and self.backend != "gloo"):
            return
        if self.backend == "gloo":
            dist.destroy_process_group()
            return
        done = threading.Event()

        def destroy() -> None:
            dist.destroy_process_group()
            done.set()

        threading.Thread(target=destroy, name="tp-leave", daemon=True).start()
        if not done.wait(wait_s):
            self.broken = self.broken or "NCCL teardown did not finish"
            log.warning(
                f"tensor parallel: rank {self.rank}'s NCCL teardown did not finish in "
                f"{wait_s:g} s; leaving it to the process's exit"
            )


# -- rank 0 -------------------------------------------------------------------------------------


@dataclass
class Team:
    """Rank 0's side: the group, the followers it started (watched), the heartbeat."""

    joined: Joined
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    on_fatal: Callable[[str], None] | None = None
    closing: bool = False
    leading: bool = False  # serving: the followers wait for operations, and beats

    @classmethod
    def start(cls, settings: Settings, spec: FamilySpec, folder: Path, launch: Launch) -> "Team":
        """Join the group as rank 0: with --tp N, start ranks 1..N-1 first and wait (at most
        TF_TP_TIMEOUT_S) until each has joined, naming one that exits before."""
        if not launch.spawned:
            return cls._started(Joined(launch, settings), {})
        store = dist.TCPStore(
            "127.0.0.1",
            0,
            launch.world,
            is_master=True,
            timeout=timedelta(seconds=settings.tp_timeout_s),
            wait_for_workers=False,
        )
        procs = {}
        try:
            for r in range(1, launch.world):
                args = {
                    "rank": r,
                    "world": launch.world,
                    "port": store.port,
                    "family": spec.name,
                    "model": str(folder),
                    "settings": settings.model_dump(mode="json"),
                }
                procs[r] = subprocess.Popen(
                    [sys.executable, "-m", "tensorfold.engine.tp_follower", json.dumps(args)]
                )
                log.info(f"tensor parallel: started follower rank {r} (pid {procs[r].pid})")
            _wait_joined(store, procs, settings.tp_timeout_s)
            joined = Joined(launch, settings, store)
        except BaseException:
            _end(procs)
            raise
        return cls._started(joined, procs)

    @classmethod
    def _started(cls, joined: Joined, procs: dict[int, subprocess.Popen]) -> "Team":
        team = cls(joined, procs)
        threading.Thread(target=team._watch, name="tensorfold-tp-watch", daemon=True).start()
        return team

    def lead(self, rank: Any) -> "Leader":
        """Rank 0's runner: rank.runner behind the proxy. Waits until every rank is ready."""
        self.joined.gather("ready")
        self.joined.last_sent = time.monotonic()
        self.leading = True
        return Leader(rank.runner, self)

    def failed(self, exc: BaseException) -> TensorParallelError:
        """The error to stop with after a collective or broadcast raised: names a follower that
        exited, when one did."""
        why = self._lost(grace_s=1.0) or (
            f"tensor parallel: a rank did not answer within TF_TP_TIMEOUT_S="
            f"{self.joined.timeout_s:g} s or its connection closed ({type(exc).__name__}: {exc})"
        )
        self.joined.broken = why
        return TensorParallelError(why)

    def _lost(self, grace_s: float = 0.0) -> str | None:
        deadline = time.monotonic() + grace_s
        while True:
            for r, proc in self.procs.items():
                code = proc.poll()
                if code is not None:
                    return (
                        f"tensor parallel: follower rank {r} (pid {proc.pid}) exited with "
                        f"status {code}"
                    )
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _watch(self) -> None:
        """Every ~50 ms: a follower that exited stops the engine (or fails the start); once
        serving, an idle channel gets a beat."""
        beat_s = self.joined.timeout_s / 4
        while not self.closing and self.joined.broken is None:
            why = self._lost()
            if why is not None and not self.closing:
                self.joined.broken = why
                if self.on_fatal is not None:
                    self.on_fatal(why)
                return
            if self.leading and time.monotonic() - self.joined.last_sent > beat_s:
                if self.joined.lock.acquire(timeout=0.05):
                    try:
                        if self.joined.broken is None and not self.closing:
                            self.joined.send(("beat",))
                    except Exception as exc:
                        why = str(self.failed(exc))
                        if self.on_fatal is not None:
                            self.on_fatal(why)
                        return
                    finally:
                        self.joined.lock.release()
            time.sleep(0.05)

    def close(self) -> None:
        """Tell the followers to leave, wait for those started here, leave the group."""
        with self.joined.lock:
            self.closing = True
            if self.joined.broken is None:
                try:
                    self.joined.send(("stop",))
                except Exception:
                    pass
        # leave first: the followers tear NCCL down as they get the stop, and so must rank 0
        # (waiting for them to exit first left rank 0's teardown waiting on ranks gone)
        self.joined.leave()
        _end(self.procs, wait_s=10.0 if self.joined.broken is None else 0.0)

    def abort(self) -> str | None:
        """Start-up failed on rank 0: end the followers started here. Returns why, when a
        follower had exited first."""
        self.closing = True
        lost = self._lost(grace_s=0.5)
        self.joined.broken = self.joined.broken or lost or "rank 0 did not start"
        _end(self.procs, wait_s=5.0)
        self.joined.leave()
        return lost


def _wait_joined(store: Any, procs: dict[int, subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for r, proc in procs.items():
        while not store.check([JOINED_KEY.format(r)]):
            code = proc.poll()
            if code is not None:
                raise TensorParallelError(
                    f"tensor parallel: follower rank {r} (pid {proc.pid}) exited with status "
                    f"{code} before it joined"
                )
            if time.monotonic() > deadline:
                raise TensorParallelError(
                    f"tensor parallel: follower rank {r} did not join within TF_TP_TIMEOUT_S="
                    f"{timeout_s:g} s"
                )
            time.sleep(0.02)


def _end(procs: dict[int, subprocess.Popen], wait_s: float = 0.0) -> None:
    """Wait up to wait_s for the followers started here to leave, then terminate the rest."""
    deadline = time.monotonic() + wait_s
    for proc in procs.values():
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()


class Leader:
    """Rank 0's runner under tensor parallel: each operation on the storage is broadcast, then
    done here. Every other attribute (pool, rows, slots, model, last_pass) is the runner's."""

    # rounds are fed from the host only: the other ranks cannot read rank 0's drawn tokens
    run_fed = None
    # a pass timed on rank 0 alone would wait in its collectives for ranks that never run it
    pass_prices = None

    def __init__(self, runner: Any, team: Team):
        self.runner = runner
        self.team = team
        if runner.pool.poison_freed:
            runner.pool.on_freed[:] = [self.poison_pages]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def _both(self, op: tuple, here: Callable[[], Any]) -> Any:
        """Broadcast `op`, then do it here; under the lock, so a beat never cuts in."""
        joined = self.team.joined
        with joined.lock:
            if joined.broken is not None:  # lost: what is left runs here alone (ending requests)
                if op[0] == "run":
                    raise TensorParallelError(joined.broken)
                return here()
            try:
                joined.send(op)
                return here()
            except TensorParallelError:
                raise
            except Exception as exc:
                raise self.team.failed(exc) from exc

    def _after(self, result: Any, op: tuple) -> Any:
        """Send an operation already done here (no collective inside): followers repeat it."""
        self._both(op, lambda: None)
        return result

    def run(self, streams: Sequence[Any]) -> list[torch.Tensor]:
        """A pass on every rank; media rows (rank 0's tower's) go to the others on the CPU,
        and each rank's pass moves them to its device (ForwardPass.embed_values)."""
        streams = list(streams)
        sent = [
            replace(s, embeds=[(at, v.cpu()) for at, v in s.embeds]) if s.embeds else s
            for s in streams
        ]
        return self._both(("run", sent), lambda: self.runner.run(streams))

    def poison_pages(self, pages: Sequence[int]) -> None:
        pages = list(pages)
        self._both(("poison_pages", pages), lambda: self.runner.rows.poison(pages))

    def poison_slot(self, slot: int) -> None:
        self._both(("poison_slot", slot), lambda: self.runner.poison_slot(slot))

    def copy_slot(self, src: int, dst: int) -> None:
        self._both(("copy_slot", src, dst), lambda: self.runner.copy_slot(src, dst))

    def rewind_slot(self, slot: int, tap: tuple[int, int]) -> None:
        self._both(("rewind", slot, tap), lambda: self.runner.rewind_slot(slot, tap))

    def attach(self, hooks: Any, lease: Any, kept_pages: list[int], kept_rows: int) -> list[int]:
        table = self.runner.attach(hooks, lease, kept_pages, kept_rows)
        return self._after(table, ("attach", list(kept_pages), kept_rows, list(lease.pages)))

    def keep_state(self, hooks: Any, arena: Any, slot: int, tap: tuple[int, int] | None) -> Any:
        snapshot = self.runner.keep_state(hooks, arena, slot, tap)
        if snapshot is None:
            return None
        return self._after(snapshot, ("keep", slot, tap, snapshot.page))

    def restore_state(self, hooks: Any, arena: Any, snapshot: Any, slot: int) -> bool:
        op = ("restore", snapshot.page, slot)
        return self._both(op, lambda: self.runner.restore_state(hooks, arena, snapshot, slot))


# -- the other ranks ----------------------------------------------------------------------------


class MirrorArena(SnapshotArena):
    """A follower's snapshot arena: rank 0 chose the page of each keep (`next_page`)."""

    next_page = 0

    def lease(self) -> Snapshot | None:
        return Snapshot(self.next_page)

    def release(self, snapshot: Snapshot) -> None:
        pass


class MirrorLease:
    """A follower's stand-in for the lease rank 0 resumed: its page table is rank 0's."""

    pool = None

    def __init__(self, table: list[int]):
        self.table = table
        self.pages: list[int] = []

    def attach(self, pages: Sequence[int]) -> None:
        self.pages = list(pages)

    def cover(self, rows: int) -> list[int]:
        self.pages = list(self.table)
        return self.pages


class Follower:
    """A rank above 0: repeats rank 0's operations on its shard until told to stop."""

    def __init__(self, rank: Any, joined: Joined):
        self.runner, self.hooks, self.arena = rank.runner, rank.hooks, rank.arena
        self.joined = joined
        self.snapshots: dict[int, Any] = {}

    def loop(self) -> None:
        while True:
            name, *args = self.joined.receive()
            if name == "stop":
                return
            getattr(self, "_" + name)(*args)

    def _run(self, streams: list) -> None:
        self.runner.run(streams)

    def _poison_pages(self, pages: list[int]) -> None:
        self.runner.rows.poison(pages)

    def _poison_slot(self, slot: int) -> None:
        self.runner.poison_slot(slot)

    def _copy_slot(self, src: int, dst: int) -> None:
        self.runner.copy_slot(src, dst)

    def _rewind(self, slot: int, tap: tuple[int, int]) -> None:
        self.runner.rewind_slot(slot, tap)

    def _attach(self, kept_pages: list[int], kept_rows: int, table: list[int]) -> None:
        self.runner.attach(self.hooks, MirrorLease(table), kept_pages, kept_rows)

    def _keep(self, slot: int, tap: tuple[int, int] | None, page: int) -> None:
        self.arena.next_page = page
        self.snapshots[page] = self.runner.keep_state(self.hooks, self.arena, slot, tap)

    def _restore(self, page: int, slot: int) -> None:
        self.runner.restore_state(self.hooks, self.arena, self.snapshots[page], slot)

    def _beat(self) -> None:
        pass


def release_graphs(runner: Any) -> None:
    """A GraphRunner's graphs dropped (a tensor-parallel rank, before it leaves the group)."""
    release = getattr(runner, "release_graphs", None)
    if release is not None:
        release()


def follow(
    settings: Settings,
    spec: FamilySpec,
    folder: Path,
    launch: Launch,
    store: Any = None,
    *,
    open_rank: Callable[..., Any],
    refusals: tuple[type[BaseException], ...],
) -> int:
    """A follower's whole life: join, open its shard (the same plan as rank 0), repeat rank 0's
    operations until it stops. Returns the exit status: 0, 2 when the start was refused (rank
    0 says why), 1 when rank 0 was lost. `open_rank` and `refusals` are start's (which imports
    this module): how a rank opens, and the refusals every rank reaches alike."""
    joined = Joined(launch, settings, store)
    try:
        rank = open_rank(settings, spec, folder, joined, arena_cls=MirrorArena)
        joined.gather("ready")
    except refusals as exc:
        log.debug("follower refused its start", rank=launch.rank, error=str(exc))
        joined.leave()  # a process that exits holding a gloo group can abort in its teardown
        return 2
    try:
        Follower(rank, joined).loop()
    except Exception as exc:
        log.error(
            f"tensor parallel: follower rank {launch.rank} lost rank 0 or failed: "
            f"{type(exc).__name__}: {exc}"
        )
        return 1
    release_graphs(rank.runner)
    joined.leave()
    return 0
