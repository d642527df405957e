"""bench/experiments/read_chain.py's plans on the CPU: the products it times, one stream's, are
the weight bytes a round's products read in a model built from the same config (lfm2_moe and
gemma4 at small shapes made from the benchmark shapes' configs), and the launch order keeps every
product with the small launches spread between them; its read kernel (under TRITON_INTERPRET=1)
sums every value once on any grid."""

from __future__ import annotations

import os
from dataclasses import replace

import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.experiments import read_chain
from tensorfold_gemma4.config import FULL, SLIDING, Gemma4Config
from tensorfold_gemma4.dummy import CONFIGS
from tensorfold_gemma4.dummy import build_dummy as build_gemma4
from tensorfold_lfm2_moe.dummy import SHAPES as LFM2
from tensorfold_lfm2_moe.dummy import build_dummy as build_lfm2


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_lfm2_plan_reads_the_built_models_product_weights() -> None:
    cfg = replace(
        LFM2["LFM2-8B-A1B"],
        num_hidden_layers=5,
        vocab_size=96,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=80,
        moe_intermediate_size=24,
        num_experts=6,
        num_experts_per_tok=2,
        layer_types=("conv", "conv", "full_attention", "conv", "full_attention"),
    )
    model = build_lfm2(cfg, "cpu", torch.bfloat16)
    want, k = [], cfg.num_experts_per_tok
    for layer in model.weights.layers:
        m, f = layer.mixer, layer.ffn
        want += (
            [nbytes(m.q, m.k, m.v), nbytes(m.out)]
            if hasattr(m, "q")
            else [nbytes(m.in_proj), nbytes(m.out_proj)]
        )
        want += (
            [nbytes(f.w1, f.w3), nbytes(f.w2)]
            if hasattr(f, "w1") and not hasattr(f, "gate")
            else [nbytes(*f.w1[:k], *f.w3[:k]), nbytes(*f.w2[:k])]
        )
    want.append(nbytes(model.weights.lm_head))
    plan = read_chain.lfm2_plan("tiny", cfg)
    assert [b for _, b in plan.products] == want
    assert [n for n, _ in plan.products][:4] == [
        "in_proj",
        "out_proj",
        "dense_gate_up",
        "dense_down",
    ]


def test_gemma4_plan_reads_the_built_models_product_weights() -> None:
    raw = {
        **CONFIGS["Gemma-4-26B-A4B"],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 40,
        "num_hidden_layers": 6,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_global_key_value_heads": 1,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 8,
        "sliding_window": 8,
        "layer_types": [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
    }
    cfg = Gemma4Config.from_dict(raw, "test")
    model = build_gemma4(cfg, "cpu", torch.bfloat16)
    want, k = [], cfg.top_k_experts
    for layer in model.weights.layers:
        a, m, e = layer.attention, layer.mlp, layer.moe
        want += [
            nbytes(*(t for t in (a.q, a.k, a.v) if t is not None)),
            nbytes(a.o),
            nbytes(m.gate, m.up),
            nbytes(m.down),
            nbytes(e.gate_up[:k]),
            nbytes(e.down[:k]),
        ]
    want.append(nbytes(model.weights.lm_head))
    assert [b for _, b in read_chain.gemma4_plan("tiny", cfg).products] == want


def test_the_chain_keeps_every_product_in_order_with_the_small_launches_between() -> None:
    for products, small in ((5, 0), (5, 3), (4, 9), (97, 90)):
        order = read_chain.interleave(products, small)
        assert [i for i in order if i >= 0] == list(range(products))
        assert order.count(-1) == small
        runs = "".join("s" if i < 0 else "p" for i in order).split("p")[:-1]
        assert max(map(len, runs)) - min(map(len, runs)) <= 1  # spread evenly


def test_the_read_kernel_sums_every_value_once() -> None:
    read = read_chain._read_kernel
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-8, 8, (5000,), generator=g).to(torch.bfloat16)  # sums exact in fp32
    for grid, block in ((1, 512), (3, 256), (7, 1024), (40, 128)):
        out = torch.zeros(grid)
        read[(grid,)](x, out, x.numel(), BLOCK=block, PDL=False)
        assert out.sum().item() == x.float().sum().item()
        assert (out != 0).sum() > (grid > 1)  # the programs split the walk


def test_the_persistent_phases_read_each_product_once_and_prefetch_the_next() -> None:
    plan = read_chain.Plan("tiny", [("a", 300), ("b", 512), ("c", 2)])
    ph = read_chain.phases_of(plan, small=2)
    reads = [(o, n) for o, n in zip(ph.offset, ph.length) if n]
    assert reads == [(0, 150), (256, 256), (512, 1)]  # each at a 128-element boundary
    assert len(ph.offset) == 5 and ph.elements == 640
    for i, (o, n) in enumerate(zip(ph.offset, ph.length)):
        later = [(a, b) for a, b in zip(ph.offset[i + 1 :], ph.length[i + 1 :]) if b]
        assert (ph.pf_offset[i], ph.pf_length[i]) == (later[0] if later else (0, 0))


def test_the_persistent_kernel_sums_each_phase_and_passes_its_barriers() -> None:
    g = torch.Generator().manual_seed(1)
    plan = read_chain.Plan("tiny", [("a", 2 * 700), ("b", 2 * 300), ("c", 2 * 1000)])
    ph = read_chain.phases_of(plan, small=2)
    x = torch.randint(-8, 8, (ph.elements,), generator=g).to(torch.bfloat16)
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    out = torch.zeros(len(ph.offset))
    spins = torch.zeros(1, dtype=torch.int32)
    cnt = torch.zeros(1, dtype=torch.int32)
    read_chain._phases_kernel[(1,)](
        x,
        t(ph.offset),
        t(ph.length),
        t(ph.pf_offset),
        t(ph.pf_length),
        cnt,
        out,
        spins,
        len(ph.offset),
        BLOCK=256,
        MAX_SPIN=4,
        PREFETCH=False,
        PF_LANES=128,
    )
    want = [x[o : o + n].float().sum().item() for o, n in zip(ph.offset, ph.length)]
    assert out.tolist() == want
    assert cnt.item() == len(ph.offset) and spins.item() == 0  # one program: no wait
