"""A prompt's own logprobs (OpenAI's `echo` with `logprobs`), from the logits rows of the pass
that computes the prompt.

Row p of a prompt pass holds the logits after tokens 0..p, so it scores prompt token p + 1.
Each row is taken on its own (log_softmax, gather and a stable sort within the row), and a
row's logits do not depend on the pass around it (docs/architecture.md, "Exactness rules"), so
a prompt's logprobs are the same bits alone, among other streams, or cut into other chunks.
They are the raw model's: no penalty, bias or temperature applies to the prompt.
"""

from __future__ import annotations

from typing import Sequence

import torch

# The most prompt rows a pass computes for a stream that keeps every row's logits: those are
# [rows, vocab] fp32, past the activation reserve a 2048-row pass plans for at a large vocab.
LOGPROB_ROWS = 128

Entry = tuple[float, list[tuple[int, float]]]  # (the token's logprob, [(id, logprob)] top first)


def prompt_rows(logits: torch.Tensor, targets: Sequence[int], top_n: int) -> list[Entry]:
    """logits: [R, V] (any float dtype) of R consecutive prompt rows; targets: the R prompt
    tokens they score. Each target's logprob, and the row's `top_n` likeliest tokens (ties to
    the lower id, as sampling orders them)."""
    if logits.dim() != 2 or logits.shape[0] != len(targets):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(targets)} targets")
    if not len(targets):
        return []
    x = logits.to(torch.float32)
    logprobs = torch.log_softmax(x, dim=1)
    index = torch.tensor(list(targets), dtype=torch.long, device=logprobs.device)
    own = logprobs.gather(1, index[:, None])[:, 0].tolist()
    top_n = min(top_n, logprobs.shape[1])
    if not top_n:
        return [(lp, []) for lp in own]
    ids = torch.sort(x, dim=1, descending=True, stable=True).indices[:, :top_n]
    tops = logprobs.gather(1, ids)
    return [
        (lp, list(zip(row_ids, row_lps)))
        for lp, row_ids, row_lps in zip(own, ids.tolist(), tops.tolist())
    ]
