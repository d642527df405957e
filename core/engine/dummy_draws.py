"""Random weights drawn in place for `TF_LOAD_FORMAT=dummy` (the families' dummy.py), as vLLM's
dummy load format: one tensor at a time on the device from a generator seeded once, so a shape
and a seed give the same weights on every run.

Under tensor parallel (`--tp N`) every rank draws its replicated tensors from the shared seed
(alike on every rank) and its slices from a seed of its own; at one rank both are one stream of
draws, in the order the family asks for them.
"""

from __future__ import annotations

import torch

from ..ops import parallel


class Draws:
    """Tensors of `dtype` on `device` from N(0, std²) (or what each method says). On the meta
    device (sizes only, for planning) there is no generator and no values."""

    def __init__(self, device: str | torch.device, dtype: torch.dtype, seed: int, std: float):
        self.device, self.dtype, self.std = torch.device(device), dtype, std
        meta = self.device.type == "meta"
        self.gen = None if meta else torch.Generator(device=self.device).manual_seed(seed)

    def normal(
        self, *shape: int, std: float | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        t = torch.empty(*shape, device=self.device, dtype=dtype or self.dtype)
        return t.normal_(0.0, self.std if std is None else std, generator=self.gen)

    def uniform(self, *shape: int, low: float, high: float) -> torch.Tensor:
        """fp32, from U(low, high)."""
        t = torch.empty(*shape, device=self.device, dtype=torch.float32)
        return t.uniform_(low, high, generator=self.gen)

    def norm(self, size: int) -> torch.Tensor:
        """A norm weight [size] in fp32: 1 + N(0, 0.1²) drawn in the model dtype."""
        return (1.0 + self.normal(size, std=0.1)).float()

    def ones(self, *shape: int) -> torch.Tensor:
        return torch.ones(*shape, device=self.device, dtype=self.dtype)

    def zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, device=self.device, dtype=self.dtype)


def rank_draws(
    device: str | torch.device, dtype: torch.dtype, seed: int, std: float
) -> tuple[Draws, Draws]:
    """(replicated, sliced): the draws for tensors every rank holds whole, and for this rank's
    slices (the same object at one rank)."""
    tp = parallel.current()
    whole = Draws(device, dtype, seed, std)
    if tp.world == 1:
        return whole, whole
    return whole, Draws(device, dtype, seed + 7919 * (tp.rank + 1), std)


def dummy_lm_head(
    init: Draws, part: Draws, embed: torch.Tensor, ties: bool, rows: range | None
) -> torch.Tensor:
    """The output projection beside the embeddings `embed` [V, H]: where the config `ties`,
    `embed` itself (its `rows` where the vocabulary is split, as a view); else drawn, whole from
    `init` or this rank's `rows` from `part`."""
    vocab, hidden = embed.shape
    if ties:
        return embed if rows is None else embed[rows.start : rows.stop]
    return init.normal(vocab, hidden) if rows is None else part.normal(len(rows), hidden)
