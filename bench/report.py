"""The figures docs/performance.md needs, from a results.json: ratios to the limits and to
transformers, and logit comparisons."""

from __future__ import annotations

import json
from typing import Any

import torch


def compare(ours: torch.Tensor, theirs: torch.Tensor) -> dict[str, float]:
    """Per-position logit error (relative, L2 over the vocabulary) and top-1 agreement."""
    diff = (ours - theirs).norm(dim=-1) / theirs.norm(dim=-1)
    return {
        "positions": ours.shape[0],
        "logits_rel_err_median": float(diff.median()),
        "logits_rel_err_max": float(diff.max()),
        "top1_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()),
    }


def short(obj: Any, limit: int = 600) -> str:
    s = json.dumps(obj, default=str)
    return s if len(s) <= limit else s[:limit] + "..."


def summary(r: dict[str, Any]) -> str:
    """The figures docs/performance.md needs, as ratios to the limits and to transformers."""
    lines = []
    env, lim, model = r.get("env", {}), r.get("limits", {}), r.get("build", {})
    lines.append(
        f"commit {env.get('commit')} gpu {env.get('gpu')} torch {env.get('torch')} "
        f"triton {env.get('triton')}"
    )
    bw = lim.get("copy", {}).get("tb_per_s")
    mm = lim.get("matmul", {}).get("tflops")
    lines.append(f"copy bandwidth {bw} TB/s; bf16 matmul {mm} TFLOP/s")
    dec = r.get("decode", {})
    hf = r.get("transformers", {})
    for n in (1, 8, 64):
        d = dec.get(f"streams{n}", {})
        tps, ftps = d.get("tokens_per_s"), d.get("forward_tokens_per_s")
        line = (
            f"decode {n} streams: {tps} tok/s through the lanes; forward alone "
            f"{d.get('forward_ms')} ms/round = {ftps} tok/s"
        )
        if tps and bw and model:
            key = "one_stream" if n == 1 else "all_experts"
            kv = n * d.get("kv_bytes_per_stream", 0)  # the cache rows a step reads, where given
            limit = bw * 1e12 / (model[key] + kv) * n
            line += (
                f"; limit {limit:.0f} tok/s ({key} bytes): fraction {tps / limit:.3f} "
                f"(forward alone {(ftps or 0) / limit:.3f})"
            )
            if n not in (1, 64) and model.get("expected_bytes", {}).get(str(n)):
                hit = bw * 1e12 / (model["expected_bytes"][str(n)] + kv) * n
                line += f"; {hit:.0f} tok/s at the experts {n} uniform rows hit: {tps / hit:.3f}"
        if "graph_replays" in d:
            line += f"; graph replays {d['graph_replays']}"
        lines.append(line)
    for name, d in r.get("decode_long", {}).items():  # other contexts, where a benchmark ran them
        if "_ctx" in name and isinstance(d, dict):
            lines.append(
                f"decode {name}: {d.get('tokens_per_s')} tok/s; fraction of its limit "
                f"{d.get('fraction_of_limit')}"
            )
    for b in (1, 16):
        h = hf.get(f"streams{b}", {})
        lines.append(f"transformers {b} streams: {h.get('tokens_per_s')} tok/s")
    pre = r.get("prefill", {})
    act = model.get("active_params")
    for n in (2048, 8192, 32768):
        p = pre.get(f"prompt{n}", {})
        line = f"prefill {n}: {p.get('tokens_per_s')} tok/s, ttft {p.get('ttft_s')} s"
        if p.get("tokens_per_s") and act and mm:
            rate = 2 * act * p["tokens_per_s"] / 1e12
            line += f"; {rate:.0f} TFLOP/s of weight matmuls = {rate / mm:.3f} of matmul rate"
        lines.append(line)
    for key in (
        "bf16_ours_vs_transformers",
        "fp32_ours_vs_transformers",
        "bf16_ours_vs_fp32_transformers",
        "bf16_transformers_vs_fp32_transformers",
    ):
        lines.append(f"{key}: {hf.get(key)}")
    lines.append(f"gates: {json.dumps(r.get('gates', {}), default=str)[:400]}")
    if "other_shape" in r:
        lines.append(f"other shape: {json.dumps(r['other_shape'], default=str)[:700]}")
    failed = [k for k, v in r.items() if isinstance(v, dict) and "error" in v]
    if failed:
        lines.append(f"sections that failed (traceback in results.json): {', '.join(failed)}")
    return "\n".join(lines)
