"""Gemma 4 speed on one GPU, in one run (docs/performance.md records the figures).

The model at Gemma-4-26B-A4B's text shape with dummy bf16 weights (tensorfold_gemma4.dummy),
through `tensorfold.lanes.Lanes` and a runner (decode rounds under CUDA graphs), not the server:
decode tokens/s at 1, 8 and 64 streams (short contexts, then 1 and 8 streams with full sliding
rings), prefill tokens/s and time to first token for 2k, 8k and 32k prompts; the GPU's copy
bandwidth and bf16 matmul rate, and the bandwidth limit (the bytes a decode step must read:
active weights plus each stream's cache rows, bench/model_bytes.py); the exactness gates in bf16
(concurrent == solo at 1, 8 and 64 streams, pages == windows, poisoned == clean); and, last,
transformers 5.23.0 `Gemma4ForCausalLM` on the same weights, `generate` at 1 and 16 streams.
The sections are lfm2_speed's where they are family-blind. Writes results.json and summary.txt.

    python bench/gemma4_speed.py --out $OUT --commit $(git rev-parse --short HEAD)
    TRITON_INTERPRET=1 python bench/gemma4_speed.py --smoke   # on the CPU, tiny, interpreted
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

if "--smoke" in sys.argv:  # before triton is imported: the kernels run in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import engine_runs  # noqa: E402
from bench.engine_sections import PAGE_ROWS  # noqa: E402
from bench.lfm2_speed import Bench  # noqa: E402
from bench.model_bytes import active_params, kv_bytes, step_bytes  # noqa: E402
from bench.report import compare  # noqa: E402
from bench.sections import sync  # noqa: E402
from bench.speed_main import choose_kernels, run_sections, speed_arguments  # noqa: E402
from tensorfold_gemma4.config import FULL, SLIDING, Gemma4Config  # noqa: E402
from tensorfold_gemma4.dummy import CONFIGS, SHAPES, build_dummy, dummy_weights  # noqa: E402
from tensorfold_gemma4.model import Gemma4Model  # noqa: E402

# The 26B's layout at toy widths: five sliding layers to one full, k_eq_v, the MoE beside the
# dense MLP, a window short enough that the smoke's prompts cross it.
SMOKE: dict[str, Any] = {
    **CONFIGS["Gemma-4-26B-A4B"],
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 96,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "global_head_dim": 64,
    "num_global_key_value_heads": 1,
    "layer_types": [SLIDING] * 5 + [FULL],
    "sliding_window": 16,
    "num_experts": 8,
    "top_k_experts": 2,
    "moe_intermediate_size": 32,
}


class Gemma4Bench(Bench):
    """lfm2_speed's sections (runner, decode, prefill, gates, profile) on a gemma4 model."""

    def env(self) -> dict[str, Any]:
        import triton

        info: dict[str, Any] = {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "commit": self.args.commit,
            "family": "gemma4",
        }
        if self.device == "cuda":
            p = torch.cuda.get_device_properties(0)
            info.update(gpu=p.name, sms=p.multi_processor_count, mem_gib=p.total_memory / 2**30)
        return info

    def config(self) -> Gemma4Config:
        if self.args.smoke:
            return Gemma4Config.from_dict(SMOKE, "gemma4_speed.SMOKE")
        return SHAPES[self.args.shape]

    def build(self) -> dict[str, Any]:
        a = time.perf_counter()
        self.model = build_dummy(
            self.config(),
            self.device,
            torch.bfloat16,
            seed=0,
            quantization=self.args.quantization,
        )
        sync(self.device)
        built = time.perf_counter() - a
        sb = step_bytes(self.model)
        return {
            "quantization": self.args.quantization,
            "shape": "smoke" if self.args.smoke else self.args.shape,
            "build_s": built,
            **sb,
            "active_params": active_params(self.model),
            "kv_bytes_per_stream": {
                str(c): kv_bytes(self.model, c) for c in (128, 1024, 2048, 8192, 32768)
            },
        }

    def decode(self) -> dict[str, Any]:
        """lfm2_speed's decode (64-row prompts, 128 new tokens), with each stream's cache reads
        (at the mean context of the timed rounds) added to the bandwidth limit."""
        res = super().decode()
        new = self.SMOKE["new"] if self.args.smoke else 128
        kv = kv_bytes(self.model, 64 + new // 2)
        for d in res.values():
            d["kv_bytes_per_stream"] = kv
        return res

    def decode_long(self) -> dict[str, Any]:
        """1 and 8 streams decoding past the window: every sliding ring full (W-1 rows a layer)."""
        res: dict[str, Any] = {}
        prompt, new = (40, 8) if self.args.smoke else (2048, 64)
        win = prompt + new + PAGE_ROWS
        bw = self.results.get("limits", {}).get("copy", {}).get("tb_per_s")
        sb = step_bytes(self.model)
        kv = kv_bytes(self.model, prompt + new // 2)
        for n in (1, 8) if not self.args.smoke else (1, 2):
            runner = self.runner(n, window=win)
            prompts = engine_runs.random_prompts(n, prompt, self.model.vocab_size, seed=20 + n)
            engine_runs.run_requests(runner, prompts, 4, lanes=n, window=win)  # capture
            run = engine_runs.run_requests(runner, prompts, new, lanes=n, window=win)
            d: dict[str, Any] = {
                "tokens_per_s": run.decode_tokens_per_s,
                "context": prompt,
                "kv_bytes_per_stream": kv,
                "graph_replays": getattr(runner, "replays", 0),
            }
            if bw:
                weights = sb["one_stream"] if n == 1 else sb["expected_bytes"]["8"]
                d["limit_tokens_per_s"] = bw * 1e12 / (weights + n * kv) * n
                d["fraction_of_limit"] = run.decode_tokens_per_s / d["limit_tokens_per_s"]
            res[f"streams{n}_ctx{prompt}"] = d
            del runner
        return res

    def transformers(self) -> dict[str, Any]:
        """Gemma4ForCausalLM on our tensors (shared, no copy), after every timing of ours: the
        runners are gone, so their pools' memory is free."""
        from bench import hf_baseline

        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
        hf = hf_baseline.build_hf(self.model)
        res: dict[str, Any] = {
            "attn_implementation": getattr(hf.config, "_attn_implementation", None)
        }
        seq = self.decode_against(hf, res)
        ours16 = self.logits(self.model, seq)
        theirs16 = self.hf_logits(hf, seq)
        res["bf16_ours_vs_transformers"] = compare(ours16, theirs16)
        del hf
        gc.collect()
        if self.args.smoke:  # fp32 copies: the mapping onto transformers, checked closely
            model32 = self.fp32_copy()
            hf32 = hf_baseline.build_hf(model32)
            theirs32 = self.hf_logits(hf32, seq)
            res["fp32_ours_vs_transformers"] = compare(self.logits(model32, seq), theirs32)
        return res

    def fp32_copy(self) -> Gemma4Model:
        """The dummy model drawn again in bf16 from the same seed, then cast to fp32."""
        assert self.model is not None
        cfg = self.model.cfg
        w = dummy_weights(cfg, self.device, torch.bfloat16, seed=0)
        return Gemma4Model(cfg, _cast(w, torch.float32), self.device, torch.float32)


def _cast(obj: Any, dtype: torch.dtype) -> Any:
    """A weights dataclass with its bf16 tensors cast to `dtype` (tied tensors stay tied)."""
    seen: dict[int, torch.Tensor] = {}

    def c(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            if id(o) not in seen:
                seen[id(o)] = o.to(dtype) if o.dtype == torch.bfloat16 else o
            return seen[id(o)]
        if isinstance(o, list):
            return [c(x) for x in o]
        if hasattr(o, "__dataclass_fields__"):  # fields made at construction (qkv) made again
            return type(o)(
                **{f.name: c(getattr(o, f.name)) for f in o.__dataclass_fields__.values() if f.init}
            )
        return o

    return c(obj)


def main() -> None:
    ap = speed_arguments(
        __doc__.splitlines()[0],
        "Gemma-4-26B-A4B",
        SHAPES,
        None,
        "skip sections once this is spent (default 540; --smoke: no limit)",
    )
    args = ap.parse_args()
    if args.budget_s is None:
        args.budget_s = float("inf") if args.smoke else 540.0
    choose_kernels(args)
    b = Gemma4Bench(args)
    # transformers last: it shares our weights, and it runs once ours is timed
    plan: list[tuple[str, Callable[[], Any], float]] = [
        ("env", b.env, 0),
        ("limits", b.limits, 30),
        ("build", b.build, 20),
        ("decode", b.decode, 60),
        ("decode_long", b.decode_long, 40),
        ("prefill", b.prefill, 40),
        ("gates", b.gates, 90),
        ("profile", b.profile, 30),
        ("census", b.census, 30),
        ("round_path", b.round_path, 30),
        ("rounds", b.rounds, 30),
        ("transformers", b.transformers, 60),
    ]
    run_sections(b, plan, ("limits", "profile", "census", "round_path", "rounds"))


if __name__ == "__main__":
    main()
