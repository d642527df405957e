"""The decoder layer of Gemma 4 over one pass's rows, as modeling_gemma4.py (5.23.0) computes it.

Rows are a pass's flat [N, H] hidden states; full attention reaches each stream's history through
its page table, sliding attention through its rings (sliding.py). Every projection goes through
the batch-invariant `linear`.

Under tensor parallel (shards.py) a rank holds its heads, its MLP channels and its experts: head
counts come from the weights (view(n, -1, d)), o_proj sums the ranks' parts (row_linear), and
the dense MLP's and the experts' partial outputs are summed in one collective (`ffn_sums`)
before their norms, which are not linear. At one rank every collective is the identity.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tensorfold.family.forward_pass import ForwardPass
from tensorfold.ops import parallel
from tensorfold.ops.attention import paged_attention
from tensorfold.ops.fp8 import kernels_take, kernels_take_ffn
from tensorfold.ops.linear import linear
from tensorfold.ops.rope import norm_rope, qkv_heads

from .config import Gemma4Config, Layer
from .ops import gelu_tanh, rms_norm
from .sliding import SlidingRows
from .weights import AttentionWeights, MlpWeights, MoeWeights, PleWeights

if TYPE_CHECKING:
    from tensorfold.adapters.paged_kv import PagedRows


def attention(
    cfg: Gemma4Config,
    layer: Layer,
    w: AttentionWeights,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    fp: ForwardPass,
    rows: "PagedRows",
    sliding: SlidingRows,
) -> torch.Tensor:
    """GQA with q/k/v RMSNorm (v without weight), RoPE on q and k, scaling 1.0, the layer's window.
    x [N, H] -> [N, H]. A full layer that owns its K/V writes the pass's rows to pages `L{i}.k` /
    `L{i}.v` first, a sliding one to its rings; a reuse layer reads its store layer's rows. Under
    k_eq_v, V is the raw k_proj output (before k_norm and RoPE) through v_norm."""
    n, d, eps = x.shape[0], layer.head_dim, cfg.rms_norm_eps
    # heads from the weights: under tensor parallel, this rank's query and KV heads
    new = None  # this layer's K and V rows [N, kv_heads, D], unless it reuses another's
    if w.qkv is None:
        raw_q = linear(x, w.q).view(n, -1, d)
    else:  # q, k (and v) from one product: [N, q | k | v] viewed as heads
        heads = linear(x, w.qkv).view(n, -1, d)
        q_heads, kv_heads = len(w.q) // d, len(w.k) // d
        v_first = q_heads if w.v is None else q_heads + kv_heads  # k_eq_v: V from raw k
        q, k, v = qkv_heads(
            heads, q_heads, kv_heads, v_first, w.q_norm, w.k_norm, eps, cos, sin, norm=rms_norm
        )
        new = (k, v)
    if new is None:
        q = norm_rope(raw_q, w.q_norm, eps, cos, sin, fp32_weight=True, norm=rms_norm)
    if layer.window is not None:
        o = sliding.attend(cfg.layers, layer, q, new, scale=1.0)
    else:
        src = f"L{layer.kv_source}"
        if new is not None:
            rows.write_many(fp.write_index, [(f"{src}.k", new[0]), (f"{src}.v", new[1])])
        o = paged_attention(
            q,
            rows.flat(f"{src}.k"),
            rows.flat(f"{src}.v"),
            fp,
            scale=1.0,
            k_scales=rows.scales(f"{src}.k"),
            v_scales=rows.scales(f"{src}.v"),
        )
    return parallel.row_linear(o.reshape(n, -1), w.o)


def mlp(w: MlpWeights, x: torch.Tensor) -> torch.Tensor:
    """GeGLU: down(gelu_tanh(gate x) · up x). x [N, H] -> [N, H]; under tensor parallel this
    rank's channels' part (see ffn_sums). On the GPU: the gated-FFN kernels of
    tensorfold.ops.triton_moe (K in fixed blocks: batch-invariant), in their fp8 form for fp8
    weights (tensorfold.ops.triton_fp8)."""
    from tensorfold.ops.gpu import use_triton

    if use_triton(x) and kernels_take_ffn(w.gate, w.up, w.down):
        from tensorfold.ops import triton_fp8

        return triton_fp8.ffn_kernel(x, w.gate, w.up, w.down, act="gelu_tanh")
    return linear(gelu_tanh(linear(x, w.gate)) * linear(x, w.up), w.down)


def moe(
    cfg: Gemma4Config,
    w: MoeWeights,
    r: torch.Tensor,
    inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The routed experts on the residual r [N, H] -> [N, H] (before post_feedforward_layernorm_2);
    under expert parallel this rank's experts' part in fp32 (see experts_ffn, ffn_sums).

    Router: z = rms_norm(r) · scale · H^-0.5 (no weight, in r's dtype), softmax(z Wᵀ) in fp32,
    top-k, renormalised to sum 1, times per_expert_scale. The experts read
    pre_feedforward_layernorm_2(r). inputs: (z, that norm of r) when made already (the
    residual's launch: ops.residual_router). Ties in the top-k go to the lower expert on the GPU
    (Triton: both inputs in one kernel, the router in tensorfold.ops.triton_route; no host sync).
    """
    from tensorfold.ops.gpu import use_triton

    eps = cfg.rms_norm_eps
    if use_triton(r):
        from tensorfold.ops import triton_route

        z, xe = inputs or triton_route.router_input(
            r, eps, w.router_scale, cfg.hidden_size**-0.5, w.pre_norm
        )
        weights, experts = triton_route.softmax_route(
            z, w.router, cfg.top_k_experts, w.per_expert_scale
        )
        return experts_ffn(xe, weights, experts, w.gate_up, w.down, w.first_expert)
    if inputs is None:
        inputs = (
            rms_norm(r, None, eps) * w.router_scale * cfg.hidden_size**-0.5,
            rms_norm(r, w.pre_norm, eps),
        )
    z, xe = inputs
    probs = torch.softmax(linear(z, w.router), dim=-1, dtype=torch.float32)  # [N, E]
    weights, experts = torch.topk(probs, cfg.top_k_experts, dim=-1)  # [N, k]
    weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * w.per_expert_scale[experts]  # fp32
    return experts_ffn(xe, weights, experts, w.gate_up, w.down, w.first_expert)


def experts_ffn(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    first: int = 0,
) -> torch.Tensor:
    """x [N, H]; weights [N, k] fp32; experts [N, k]; gate_up [E, 2I, H]; down [E, H, I].

    Σ_j weights[:, j] · down_e(gelu_tanh(gate_e x) · up_e x) for e = experts[:, j], each product
    kept in fp32 and summed in slot order, then rounded to x's dtype (the reference's grouped_mm
    path). An expert's rows are gathered and multiplied on their own, so a row's result does not
    depend on which other rows share its experts. On the GPU: tensorfold.ops.triton_moe, the
    gate and up halves of gate_up read as strided views (fp8: its fp8 form, triton_fp8, the
    halves cut once, gate_and_up).

    Under expert parallel gate_up and down hold this rank's experts, first .. first + E - 1:
    returns their share of the sum, in fp32 [N, H] (tensorfold.ops.parallel.local_moe, on the
    CPU and the GPU), which ffn_sums adds up across ranks."""
    from tensorfold.ops.gpu import use_triton

    i = down.shape[2]
    if parallel.current().world > 1:
        return parallel.local_moe(
            x,
            weights,
            experts,
            gate_up[:, :i],
            gate_up[:, i:],
            down,
            first,
            act="gelu_tanh",
            fp32_slots=True,
        )
    if use_triton(x) and kernels_take(gate_up, down):
        from tensorfold.ops import triton_fp8

        gate, up = triton_fp8.gate_and_up(gate_up, i)
        return triton_fp8.moe_kernel(
            x, weights, experts, gate, up, down, act="gelu_tanh", slot_dtype=torch.float32
        )
    n, k = experts.shape
    flat = experts.reshape(-1)  # entry r*k + j is row r's slot j
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    slots = torch.empty(n * k, x.shape[1], dtype=torch.float32, device=x.device)
    flat_weights = weights.reshape(-1)
    start = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        picks = order[start : start + count]
        start += count
        gate, up = linear(x.index_select(0, picks // k), gate_up[e]).chunk(2, dim=-1)
        y = linear(gelu_tanh(gate) * up, down[e])
        slots[picks] = y * flat_weights[picks, None]
    per_slot = slots.view(n, k, -1)
    acc = per_slot[:, 0]
    for j in range(1, k):
        acc = acc + per_slot[:, j]
    return acc.to(x.dtype)


def ffn_sums(m: torch.Tensor, e: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The dense MLP's output m [N, H] (model dtype) and the experts' e [N, H] (None: no MoE),
    each summed over the ranks' parts and rounded to m's dtype, in one collective ([N, 2H] in
    fp32: the sums are elementwise, so one gather gives each the bits of its own sum). At one
    rank: m and e as given."""
    if parallel.current().world == 1:
        return m, e
    if e is None:
        return parallel.sum_partials(m), None
    h = m.shape[-1]
    both = parallel.sum_partials(torch.cat([m.float(), e.float()], dim=-1), torch.float32)
    return both[:, :h].to(m.dtype), both[:, h:].to(m.dtype)


def per_layer_input(w: PleWeights, h: torch.Tensor, ple: torch.Tensor, eps: float) -> torch.Tensor:
    """post_norm(projection(gelu_tanh(gate h) · ple)). h [N, H]; ple [N, P] -> [N, H]."""
    g = gelu_tanh(linear(h, w.gate)) * ple
    return rms_norm(linear(g, w.projection), w.post_norm, eps)
