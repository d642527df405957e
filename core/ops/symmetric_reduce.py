"""Small partial sums over the ranks through symmetric memory, in one kernel (CUDA, one host).

Each rank holds a symmetric buffer of SLOTS slots of `slot_bytes`, mapped into every other
rank's address space. A call (`OneShot.sum`) runs three steps on the current stream:

    write   this rank's partial into its own buffer's slot s
    barrier every rank has written (torch's symmetric-memory barrier: a kernel that signals each
            peer and waits for each peer's signal)
    read    one kernel reads slot s of every rank's buffer, adds the values in rank order in
            fp32 and rounds once (ops/triton_rank_sum.py)

so every rank gets the same bits as the NCCL path (`parallel.rank_order_sum` over an
all_gather), and a row's sum depends only on that row's partials. All three are kernels on the
current stream, so a decode round's calls are captured in its CUDA graph.

The race: a rank must not overwrite slot s while a peer still reads the previous call's values
there. Calls alternate between two slots, so call n writes the slot call n - 2 used, and every
peer finished reading it before it signalled the barrier of call n - 1, which this rank has
passed. A graph replays the slots it was captured with, whatever the calls before it used; so
each pass begins with `begin_pass`: a barrier (every peer has finished every read before it)
and the count back to slot 0. Passes on every rank run the same calls in the same order (the
ranks repeat rank 0's operations), so the counts agree.

Messages above `slot_bytes` go through NCCL (the caller's choice, by `takes`).
"""

from __future__ import annotations

from typing import Any

import torch

from tensorfold.config.logs import get_logger

_log = get_logger("tensorfold.ops.symmetric_reduce")

SLOTS = 2
# 8 MiB a slot: the largest decode bucket (256 rows) of the widest partial the shipped families
# send (gemma4's fp32 pair, 2 x 2816 x 4 bytes a row = 5.6 MiB) fits; beyond a few MiB the sum is
# bandwidth-bound, where NCCL's all_gather reads as fast and the buffer need not grow.
SLOT_BYTES = 8 << 20
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class OneShot:
    """The order of a call's steps and of the pass fence; a subclass provides the steps."""

    def __init__(self, rank: int, world: int, slot_bytes: int = SLOT_BYTES):
        self.rank, self.world, self.slot_bytes = rank, world, slot_bytes
        self.calls = 0  # calls since the pass began: call n uses slot n % SLOTS

    def takes(self, x: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether this message goes through symmetric memory (else NCCL)."""
        return x.is_cuda and self.fits(x.numel() * x.element_size(), x.dtype, dtype)

    def fits(self, nbytes: int, dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
        """The size bound: a message of nbytes fits a slot."""
        return nbytes <= self.slot_bytes and dtype in DTYPES and out_dtype in DTYPES

    def begin_pass(self) -> None:
        self.calls = 0
        self._barrier()

    def sum(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Σ over ranks of x [..., H], in rank order in fp32, rounded to dtype."""
        slot = self.calls % SLOTS
        self.calls += 1
        self._write(slot, x)
        self._barrier()
        return self._read_sum(slot, x, dtype)

    # -- the steps ---------------------------------------------------------------------------

    def _write(self, slot: int, x: torch.Tensor) -> None:
        raise NotImplementedError

    def _barrier(self) -> None:
        raise NotImplementedError

    def _read_sum(self, slot: int, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError


class SymmetricReduce(OneShot):
    """OneShot over torch's symmetric memory (CUDA backend; no multicast)."""

    def __init__(
        self,
        handle: Any,
        buffer: torch.Tensor,
        rank: int,
        world: int,
        slot_bytes: int,
        timeout_ms: int,
    ):
        super().__init__(rank, world, slot_bytes)
        self.handle = handle
        self.buffer = buffer  # [SLOTS * slot_bytes] uint8: this rank's; keeps the memory alive
        self.timeout_ms = timeout_ms
        # The buffer may sit inside a larger symmetric allocation (torch's implicit pool), at the
        # same offset on every rank; get_buffer counts from the allocation's start.
        offset = buffer.data_ptr() - int(handle.buffer_ptrs[rank])
        if offset < 0:
            raise RuntimeError("the symmetric buffer lies before its allocation's start")
        peers = [
            handle.get_buffer(r, (SLOTS * slot_bytes,), torch.uint8, offset) for r in range(world)
        ]
        if peers[rank].data_ptr() != buffer.data_ptr():
            raise RuntimeError(
                "the symmetric memory handle's view of this rank's buffer is not the buffer"
            )
        self.peers = peers
        self._views: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}

    def views(self, slot: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Slot `slot` of every rank's buffer as flat `dtype` tensors, in rank order."""
        key = (slot, dtype)
        if key not in self._views:
            lo = slot * self.slot_bytes
            self._views[key] = [p[lo : lo + self.slot_bytes].view(dtype) for p in self.peers]
        return self._views[key]

    def _write(self, slot: int, x: torch.Tensor) -> None:
        mine = self.views(slot, x.dtype)[self.rank]
        mine[: x.numel()].copy_(x.reshape(-1))

    def _barrier(self) -> None:
        self.handle.barrier(channel=0, timeout_ms=self.timeout_ms)

    def _read_sum(self, slot: int, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        from .triton_rank_sum import rank_sum

        out = torch.empty(x.shape, dtype=dtype, device=x.device)
        return rank_sum(self.views(slot, x.dtype), out)


def multicast_on(handle: Any) -> bool:
    """Whether a symmetric-memory handle signals through NVLink multicast: its multicast_ptr is
    set. (torch 2.11's has_multicast_support is a static check of a device, not of the handle:
    calling it on the handle raised a TypeError on the two-GPU machine.)"""
    ptr = getattr(handle, "multicast_ptr", 0)
    return isinstance(ptr, int) and ptr != 0


def open_symmetric(
    group: Any,
    rank: int,
    world: int,
    device: torch.device,
    timeout_s: float,
    slot_bytes: int = SLOT_BYTES,
) -> SymmetricReduce:
    """Allocate and exchange the buffers (a collective: every rank of `group` calls it), then
    check them with one sum. Raises when this torch or machine cannot (the caller falls back)."""
    import torch.distributed._symmetric_memory as symm_mem

    from .triton_rank_sum import MAX_WORLD

    if world > MAX_WORLD:
        raise RuntimeError(f"the one-shot sum takes at most {MAX_WORLD} ranks, not {world}")
    buffer = symm_mem.empty(SLOTS * slot_bytes, dtype=torch.uint8, device=device)
    try:
        handle = symm_mem.rendezvous(buffer, group)
    except RuntimeError:
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is None:
            raise
        import warnings

        # older torch wants the group registered first (deprecated, then removed, since)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(group.group_name)
        handle = symm_mem.rendezvous(buffer, group)
    if handle is None:
        raise RuntimeError("symmetric memory rendezvous returned nothing")
    if multicast_on(handle):
        # torch's barrier then signals through NVLink multicast: say so where it must stay off
        _log.warning(
            "symmetric memory has NVLink multicast on; TORCH_SYMM_MEM_DISABLE_MULTICAST=1 "
            "turns it off where it must stay off"
        )
    reduce = SymmetricReduce(
        handle, buffer, rank, world, slot_bytes, timeout_ms=max(1, int(timeout_s * 1000))
    )
    reduce.begin_pass()
    probe = torch.full((16,), float(rank + 1), device=device)
    got = reduce.sum(probe, torch.float32)
    reduce.begin_pass()  # the probe's read is done everywhere before any later write
    want = world * (world + 1) / 2
    if not bool((got == want).all()):
        raise RuntimeError(f"the symmetric sum's self-check gave {got[:4].tolist()}, not {want}")
    return reduce
