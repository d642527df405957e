"""Row-invariant building blocks the glm5_next layers share (torch, the CPU path).

A row's bits must not depend on the pass it sits in: products go through fixed-shape blocks
(`tensorfold.ops.linear`, `head_linear`), transcendental functions are built from `exp`
(torch's own sigmoid/silu round differently in a tensor's vectorised body and its scalar tail),
and reductions run over a row's own last dimension or as explicit loops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorfold.ops.gpu import use_triton
from tensorfold.ops.moe import sigmoid, silu

__all__ = ["sigmoid", "silu", "head_linear", "softmax", "layer_norm", "ROW_BLOCK"]

ROW_BLOCK = 16


def head_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A separate linear map per head. x [n, heads, K]; weight [heads, N, K] -> [n, heads, N].

    Rows go through in zero-padded blocks of ROW_BLOCK, so a row's result does not depend on how
    many rows the pass holds. On the GPU: triton_mla.head_linear (fixed K order)."""
    if use_triton(x):
        from .triton_mla import head_linear as triton_head_linear

        return triton_head_linear(x, weight)
    n = x.shape[0]
    pad = (-n) % ROW_BLOCK
    xs = F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1)  # [heads, n', K]
    wt = weight.transpose(1, 2)  # [heads, K, N]
    out = xs.new_empty(xs.shape[0], xs.shape[1], weight.shape[1])
    for i in range(0, xs.shape[1], ROW_BLOCK):
        torch.bmm(xs[:, i : i + ROW_BLOCK], wt, out=out[:, i : i + ROW_BLOCK])
    return out[:, :n].transpose(0, 1)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, from exp (fp32 in, fp32 out)."""
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """LayerNorm over the last dimension, computed in fp32 and rounded to x's dtype (as
    torch's CPU kernel does for a reduced-precision input). x [..., D]; weight, bias [D].
    On the GPU: triton_indexer.layer_norm (each row reduces only its own elements)."""
    if use_triton(x):
        from .triton_indexer import layer_norm as triton_layer_norm

        return triton_layer_norm(x, weight, bias, eps)
    xf = x.float()
    centred = xf - xf.mean(-1, keepdim=True)
    var = centred.pow(2).mean(-1, keepdim=True)
    return (centred * torch.rsqrt(var + eps) * weight.float() + bias.float()).to(x.dtype)
