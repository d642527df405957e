"""Gemma 4's elementwise pieces on the GPU in Triton, rounding as ops.py does step by step.

- `rms_norm`: Gemma4RMSNorm per row (or per head: any [..., D]), optional fp32 weight.
- `residual`: the sandwich norms' residual adds of a decoder layer fused with the next norm:
  t = a (or rms_norm(a, wa)); t = bf16(t + rms_norm(e, we)); t = rms_norm(t, wpost);
  h' = bf16(h + t); h' = bf16(h' · scalar); x = rms_norm(h', wnext); each step optional.
  `residual_router` also makes the MoE's router and experts' inputs from h' in that launch.
- `gelu_tanh` and `gelu_mul` (gelu_tanh(a) rounded, times b rounded).
- `softcap_float`: cap·tanh(logits / cap) in logits' dtype, written as fp32.

Each program takes whole rows and reduces each row's own elements in an order fixed by the row
width, so a row's bits never depend on the other rows of the pass. tanh is built from exp
(the interpreter has no libdevice): tanh|x| = (1 - e^(-2|x|)) / (1 + e^(-2|x|)).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tensorfold.ops.gpu import launch_options
from tensorfold.ops.triton_util import after_prior, cdiv, next_power_of_2

_GELU_C = math.sqrt(2.0 / math.pi)
ELEMENTS = 1024  # elements a program of the elementwise kernels takes


@triton.jit
def tanh(x):
    """fp32 tanh from exp, odd and saturating (no overflow: the exponent is never positive)."""
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def gelu(x, C: tl.constexpr):
    """0.5·x·(1 + tanh(C·(x + 0.044715·x³))), x fp32."""
    return 0.5 * x * (1.0 + tanh(C * (x + 0.044715 * (x * x * x))))


@triton.jit
def _normed(x, w_ptr, cols, cmask, D, eps, HAS_W: tl.constexpr):
    """rms_norm of fp32 rows x [ROWS, BLOCK_D] (zeros past D), fp32, not yet rounded."""
    var = tl.sum(x * x, axis=1) / D
    out = x * tl.math.rsqrt(var + eps)[:, None]
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        out = out * w[None, :]
    return out


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    o_ptr,
    n_rows,
    D,
    eps,
    heads,
    stride_n,
    HAS_W: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Row r of the output is head r % heads of x's row r // heads (x's rows stride_n apart,
    its heads D apart: a view of some heads of a wider row)."""
    after_prior(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    mask = (rows[:, None] < n_rows) & cmask[None, :]
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    src = ((rows // heads).to(tl.int64) * stride_n + (rows % heads) * D)[:, None] + cols[None, :]
    x = tl.load(x_ptr + src, mask=mask, other=0.0).to(tl.float32)
    out = _normed(x, w_ptr, cols, cmask, D, eps, HAS_W)
    tl.store(o_ptr + offs, out.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _residual_kernel(
    h_ptr,
    a_ptr,
    e_ptr,
    wa_ptr,
    we_ptr,
    wp_ptr,
    s_ptr,
    wn_ptr,
    ho_ptr,
    xo_ptr,
    n_rows,
    D,
    eps,
    NORM_A: tl.constexpr,
    HAS_E: tl.constexpr,
    HAS_POST: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_NEXT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    rs_ptr=None,
    rw_ptr=None,
    z_ptr=None,
    xe_ptr=None,
    const=1.0,
    ROUTER: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """One program a tile of whole rows: the steps of the module docstring. ROUTER: also
    gemma4's router and experts' inputs from h' (triton_route.router_input's formula):
    z = ((x̂ → dtype) · rs → dtype) · const → dtype, xe = x̂ · rw → dtype."""
    after_prior(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    mask = (rows[:, None] < n_rows) & cmask[None, :]
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    dt = ho_ptr.dtype.element_ty
    t = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if NORM_A:
        t = _normed(t, wa_ptr, cols, cmask, D, eps, True).to(dt).to(tl.float32)
    if HAS_E:
        e = tl.load(e_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        e = _normed(e, we_ptr, cols, cmask, D, eps, True).to(dt).to(tl.float32)
        t = (t + e).to(dt).to(tl.float32)
    if HAS_POST:
        t = _normed(t, wp_ptr, cols, cmask, D, eps, True).to(dt).to(tl.float32)
    h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = (h + t).to(dt).to(tl.float32)
    if HAS_SCALE:
        h = (h * tl.load(s_ptr).to(tl.float32)).to(dt).to(tl.float32)
    tl.store(ho_ptr + offs, h.to(dt), mask=mask)
    if ROUTER:
        normed = _normed(h, rw_ptr, cols, cmask, D, eps, False)
        rs = tl.load(rs_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        z = (normed.to(dt).to(tl.float32) * rs[None, :]).to(dt).to(tl.float32)
        tl.store(z_ptr + offs, (z * const).to(dt), mask=mask)
        rw = tl.load(rw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(xe_ptr + offs, (normed * rw[None, :]).to(dt), mask=mask)
    if HAS_NEXT:
        x = _normed(h, wn_ptr, cols, cmask, D, eps, True)
        tl.store(xo_ptr + offs, x.to(dt), mask=mask)


@triton.jit(do_not_specialize=["n"])
def _gelu_kernel(
    a_ptr,
    b_ptr,
    o_ptr,
    n,
    HAS_B: tl.constexpr,
    C: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    after_prior(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    dt = o_ptr.dtype.element_ty
    y = gelu(tl.load(a_ptr + offs, mask=m, other=0.0).to(tl.float32), C).to(dt)
    if HAS_B:
        b = tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) * b).to(dt)
    tl.store(o_ptr + offs, y, mask=m)


@triton.jit(do_not_specialize=["n"])
def _softcap_kernel(x_ptr, o_ptr, n, cap, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    after_prior(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = tanh((x / cap).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    tl.store(o_ptr + offs, (y * cap).to(dt).to(tl.float32), mask=m)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _tiling(d: int) -> tuple[int, int]:
    """(rows a program, BLOCK_D) from the row width alone."""
    block_d = next_power_of_2(d)
    return max(1, min(16, 4096 // block_d)), block_d


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] fp32 or None -> [..., D] in x's dtype (contiguous). A view
    [N, heads, D] of some heads of wider rows (heads D apart) is read in place."""
    d = x.shape[-1]
    if x.dim() == 3 and x.stride(-1) == 1 and x.stride(-2) == d:
        src, heads, stride_n = x, x.shape[1], x.stride(0)
    else:
        src = _rows(x)
        heads, stride_n = 1, d
    n = x.numel() // d
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    per, block_d = _tiling(d)
    if n:
        _rms_norm_kernel[(cdiv(n, per),)](
            src,
            weight if weight is not None else out,
            out,
            n,
            d,
            eps,
            max(heads, 1),
            stride_n,
            HAS_W=weight is not None,
            ROWS=per,
            BLOCK_D=block_d,
            num_warps=4,
            **launch_options(out),
        )
    return out


def residual(
    h: torch.Tensor,
    a: torch.Tensor,
    eps: float,
    *,
    wa: torch.Tensor | None = None,
    e: torch.Tensor | None = None,
    we: torch.Tensor | None = None,
    wpost: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    wnext: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h, a, e [N, H]; norm weights [H] fp32; scale [1] -> (h' [N, H], x [N, H] or None).
    See the module docstring for the steps; `we` goes with `e`."""
    h_out, x_out, _ = _residual(h, a, eps, wa, e, we, wpost, scale, wnext, None)
    return h_out, x_out


def residual_router(
    h: torch.Tensor,
    a: torch.Tensor,
    eps: float,
    *,
    wa: torch.Tensor,
    wnext: torch.Tensor,
    router_scale: torch.Tensor,
    const: float,
    pre_norm: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """residual(h, a, eps, wa=wa, wnext=wnext) and, in the same launch, gemma4's router and
    experts' inputs from h' (triton_route.router_input's formula): (h', x, z, xe), [N, H] each.
    router_scale [H] in h's dtype; pre_norm [H] fp32."""
    h_out, x_out, inputs = _residual(
        h, a, eps, wa, None, None, None, None, wnext, (router_scale, const, pre_norm)
    )
    assert x_out is not None and inputs is not None
    return h_out, x_out, *inputs


def _residual(h, a, eps, wa, e, we, wpost, scale, wnext, router):
    hr, ar = _rows(h), _rows(a)
    er = _rows(e) if e is not None else ar
    n, d = hr.shape
    h_out = torch.empty_like(hr)
    x_out = torch.empty_like(hr) if wnext is not None else h_out
    per, block_d = _tiling(d)
    dummy = hr
    extra = {}
    inputs = None
    if router is not None:
        rs, const, rw = router
        inputs = (torch.empty_like(hr), torch.empty_like(hr))
        extra = dict(
            rs_ptr=rs.contiguous(),
            rw_ptr=rw.contiguous(),
            z_ptr=inputs[0],
            xe_ptr=inputs[1],
            const=float(const),
            ROUTER=True,
        )
    if n:
        _residual_kernel[(cdiv(n, per),)](
            hr,
            ar,
            er,
            wa if wa is not None else dummy,
            we if we is not None else dummy,
            wpost if wpost is not None else dummy,
            scale if scale is not None else dummy,
            wnext if wnext is not None else dummy,
            h_out,
            x_out,
            n,
            d,
            eps,
            NORM_A=wa is not None,
            HAS_E=e is not None,
            HAS_POST=wpost is not None,
            HAS_SCALE=scale is not None,
            HAS_NEXT=wnext is not None,
            ROWS=per,
            BLOCK_D=block_d,
            num_warps=4,
            **extra,
            **launch_options(hr),
        )
    if inputs is not None:
        inputs = tuple(t.view(h.shape) for t in inputs)
    return h_out.view(h.shape), (x_out.view(h.shape) if wnext is not None else None), inputs


def _elementwise(a: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    ac = a.contiguous()
    bc = b.contiguous() if b is not None else ac
    out = torch.empty_like(ac)
    n = ac.numel()
    if n:
        _gelu_kernel[(cdiv(n, ELEMENTS),)](
            ac,
            bc,
            out,
            n,
            HAS_B=b is not None,
            C=_GELU_C,
            BLOCK=ELEMENTS,
            num_warps=4,
            **launch_options(ac),
        )
    return out


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """x [...] -> gelu_tanh(x) in x's dtype."""
    return _elementwise(x, None)


def gelu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a, b [...] of one dtype and shape -> gelu_tanh(a) · b."""
    return _elementwise(a, b)


def softcap_float(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """logits [...] -> cap·tanh(logits / cap) rounded to logits' dtype at each step, as fp32."""
    x = logits.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = x.numel()
    if n:
        _softcap_kernel[(cdiv(n, ELEMENTS),)](
            x, out, n, cap, BLOCK=ELEMENTS, num_warps=4, **launch_options(x)
        )
    return out
