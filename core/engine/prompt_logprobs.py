"""A prompt's own logprobs (OpenAI's `echo` with `logprobs`), from the logits rows of the pass
that computes the prompt.

Row p of a prompt pass holds the logits after tokens 0..p, so it scores prompt token p + 1.
Each row is taken on its own, as the sampler takes a row's logprobs (`sampling.row_logprobs`:
torch's log_softmax, or the row kernel on the GPU; a stable sort within the row for the top
ones), and a row's logits do not depend on the pass around it (docs/architecture.md,
"Exactness rules"), so a prompt's logprobs are the same bits alone, among other streams, or cut
into other chunks, and a prompt token is scored as decoding scored it after the same tokens.
They are the raw model's: no penalty, bias or temperature applies to the prompt.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..ops.gpu import use_triton
from .sampling import row_logprobs

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
    kernel = use_triton(logits)
    x = logits.to(torch.float32)
    if kernel:
        x = x.contiguous()  # the row kernel reads unit-stride rows
    _, logprobs_at = row_logprobs(x, kernel)
    index = torch.tensor(list(targets), dtype=torch.long, device=x.device)
    own = logprobs_at(index[:, None])[:, 0].tolist()
    top_n = min(top_n, x.shape[1])
    if not top_n:
        return [(lp, []) for lp in own]
    ids = torch.sort(x, dim=1, descending=True, stable=True).indices[:, :top_n]
    tops = logprobs_at(ids)
    return [
        (lp, list(zip(row_ids, row_lps)))
        for lp, row_ids, row_lps in zip(own, ids.tolist(), tops.tolist())
    ]
