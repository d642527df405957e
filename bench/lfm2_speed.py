"""LFM2-MoE speed on one GPU, in one run (docs/performance.md records the figures).

The model at LFM2-8B-A1B's shape with dummy bf16 weights (tensorfold_lfm2_moe.dummy), through
`tensorfold.lanes.Lanes` and a runner (decode rounds under CUDA graphs), not the server:
decode tokens/s at 1, 8 and 64 streams, prefill tokens/s and time to first token for 2k, 8k and
32k prompts; the GPU's copy bandwidth and bf16 matmul rate; transformers 5.23.0 `generate` on the
same weights at 1 and 16 streams; and the exactness gates in bf16 (concurrent == solo at 1, 8 and
64 streams, pages == windows, poisoned == clean). Writes results.json and summary.txt to --out.

    python bench/lfm2_speed.py --out $OUT --commit $(git rev-parse --short HEAD)
    python bench/lfm2_speed.py --smoke   # the whole script on the CPU, tiny, Triton interpreted
"""

from __future__ import annotations

import inspect
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

if "--smoke" in sys.argv:  # before triton is imported: the kernels run in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import engine_runs  # noqa: E402
from bench.engine_sections import PAGE_ROWS, EngineSections  # noqa: E402
from bench.model_bytes import active_params, step_bytes  # noqa: E402
from bench.report import compare  # noqa: E402
from bench.speed_main import choose_kernels, run_sections, speed_arguments  # noqa: E402
from tensorfold.engine.runner import ModelRunner  # noqa: E402
from tensorfold.ops.conv import gated_conv  # noqa: E402
from tensorfold.ops.linear import linear  # noqa: E402
from tensorfold_lfm2_moe import layers  # noqa: E402
from tensorfold_lfm2_moe.config import Lfm2MoeConfig  # noqa: E402
from tensorfold_lfm2_moe.dummy import SHAPES, build_dummy  # noqa: E402


def pass_level_short_conv(name, w, x, fp, slots):
    """layers.short_conv with its per-stream loop replaced by ops.conv.gated_conv (one kernel
    pair for the pass, capturable in a graph); same bits on the CPU."""
    bcx = linear(x, w.in_proj, w.in_bias)  # [N, 3H]: B, C, x
    y = gated_conv(bcx, slots.get(f"{name}.conv"), fp, w.conv, w.conv_bias, f"{name}.conv")
    return linear(y, w.out_proj, w.out_bias)


def use_pass_level_conv() -> bool:
    """Until the plugin's layers.short_conv calls ops.conv.gated_conv itself."""
    if "gated_conv" in inspect.getsource(layers.short_conv):
        return False
    layers.short_conv = pass_level_short_conv
    return True


def smoke_config(cfg: Lfm2MoeConfig, **more: Any) -> Lfm2MoeConfig:
    """cfg's layout at --smoke's tiny sizes (four layers, one of them attention), with `more`."""
    return replace(
        cfg,
        num_hidden_layers=4,
        vocab_size=512,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_experts=8,
        layer_types=("conv", "conv", "full_attention", "conv"),
        **more,
    )


# --- sections --------------------------------------------------------------------------------


class Bench(EngineSections):
    # each section returns a JSON-able dict

    def env(self) -> dict[str, Any]:
        import triton

        info = {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "commit": self.args.commit,
            "pass_level_conv_shim": use_pass_level_conv(),
        }
        if self.device == "cuda":
            p = torch.cuda.get_device_properties(0)
            info.update(gpu=p.name, sms=p.multi_processor_count, mem_gib=p.total_memory / 2**30)
        return info

    def limits(self) -> dict[str, Any]:
        from bench import limits

        return {"copy": limits.copy_bandwidth(), "matmul": limits.matmul_rate()}

    def build(self) -> dict[str, Any]:
        cfg = SHAPES[self.args.shape]
        if self.args.smoke:
            cfg = smoke_config(cfg)
        a = time.perf_counter()
        self.model = build_dummy(
            cfg, self.device, torch.bfloat16, seed=0, quantization=self.args.quantization
        )
        if self.device == "cuda":
            torch.cuda.synchronize()
        sb = step_bytes(self.model)
        return {
            "shape": self.args.shape,
            "quantization": self.args.quantization,
            "build_s": time.perf_counter() - a,
            **sb,
            "active_params": active_params(self.model),
        }

    def transformers(self) -> dict[str, Any]:
        from bench import hf_baseline

        hf = hf_baseline.build_hf(self.model)
        res: dict[str, Any] = {}
        seq = self.decode_against(hf, res)
        res["attn_implementation"] = getattr(hf.config, "_attn_implementation", None)
        ours16 = self.logits(self.model, seq)
        theirs16 = self.hf_logits(hf, seq)
        del hf
        res["bf16_ours_vs_transformers"] = compare(ours16, theirs16)
        # fp32 copies of the same weights: our kernels (fp32 dots) against transformers in fp32,
        # and how far each bf16 run is from that
        from tensorfold_lfm2_moe.dummy import cast

        model32 = cast(self.model, torch.float32)
        hf32 = hf_baseline.build_hf(model32)
        theirs32 = self.hf_logits(hf32, seq)
        del hf32
        res["fp32_ours_vs_transformers"] = compare(self.logits(model32, seq), theirs32)
        res["bf16_ours_vs_fp32_transformers"] = compare(ours16, theirs32)
        res["bf16_transformers_vs_fp32_transformers"] = compare(theirs16, theirs32)
        del model32
        torch.cuda.empty_cache()
        return res

    def decode_against(self, hf, res: dict[str, Any]) -> list[int]:
        """Into res: transformers' decode rate (`streams1`, `streams16`; --smoke: 1 and 2) and
        for how many greedy tokens it agrees with ours on the same weights, both bf16. Returns
        the prompt with our tokens after it."""
        from bench import hf_baseline

        vocab = self.model.vocab_size
        short, long = (4, 12) if self.args.smoke else (8, 40)
        for b in (1, 16) if not self.args.smoke else (1, 2):
            prompts = torch.tensor(
                engine_runs.random_prompts(b, 64, vocab, seed=b), device=self.device
            )
            res[f"streams{b}"] = hf_baseline.decode_rate(hf, prompts, short, long)
        # random weights give flat logits, so bf16 rounding flips close argmaxes: a sanity
        # figure; the fp32 parity tests are the gate
        prompt = engine_runs.random_prompts(1, 64, vocab, seed=99)[0]
        theirs, _ = hf_baseline.generate(hf, torch.tensor([prompt], device=self.device), 32)
        ours = (
            engine_runs.run_requests(
                self.runner(1, window=1024), [prompt], 32, lanes=1, window=1024
            )
            .outcomes[0]
            .tokens
        )
        theirs_list = theirs[0].tolist()
        res["greedy_tokens_agree_for"] = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs_list)) if a != b), len(ours)
        )
        return prompt + ours

    def hf_logits(self, hf, tokens: list[int]) -> torch.Tensor:
        """Every position's logits from transformers' model over `tokens`: [len, V] fp32."""
        with torch.inference_mode():
            return hf(torch.tensor([tokens], device=self.device)).logits[0].float()

    def logits(self, model, tokens: list[int]) -> torch.Tensor:
        """Every position's logits from one pass over `tokens`: [len, V] fp32."""
        from tensorfold.family.forward_pass import StreamRows

        runner = ModelRunner(model, num_pages=2, num_slots=1, page_rows=PAGE_ROWS)
        (out,) = runner.run([StreamRows(0, 0, tokens, [0, 1], "all")])
        return out

    def other_shape(self) -> dict[str, Any]:
        """LFM2-24B-A2B's shape: decode at 1 and 64 streams, an 8k prefill."""
        self.model = None
        torch.cuda.empty_cache()
        self.args.shape = "LFM2-24B-A2B"
        built = self.build()
        res: dict[str, Any] = {"model": built}
        for n in (1, 64):
            runner = self.runner(n, window=1024)
            prompts = engine_runs.random_prompts(n, 64, self.model.vocab_size, seed=n)
            engine_runs.run_requests(runner, prompts, 4, lanes=n, window=1024)
            run = engine_runs.run_requests(runner, prompts, 64, lanes=n, window=1024)
            fwd = self.forward_ms(runner, prompts)
            res[f"decode_streams{n}"] = {
                "tokens_per_s": run.decode_tokens_per_s,
                "forward_ms": fwd,
                "forward_tokens_per_s": 1e3 * n / fwd,
            }
            del runner
        runner = self.runner(1)
        p = engine_runs.random_prompts(1, 8192, self.model.vocab_size, seed=8)
        engine_runs.run_requests(runner, p, 1, lanes=1, window=self.window)  # warm
        run = engine_runs.run_requests(runner, p, 1, lanes=1, window=self.window)
        o = run.outcomes[0]
        res["prefill8192"] = {
            "ttft_s": o.first - o.submitted,
            "tokens_per_s": 8192 / (o.first - o.submitted),
        }
        return res


def main() -> None:
    ap = speed_arguments(__doc__.splitlines()[0], "LFM2-8B-A1B", SHAPES, 430.0)
    ap.add_argument("--max-splits", type=int, help="override triton_splitk.MAX_SPLITS")
    ap.add_argument("--tiny-block-m", type=int, help="override the 16-row tile of tiny passes")
    args = ap.parse_args()
    from tensorfold.ops import triton_linear, triton_moe, triton_splitk

    if args.max_splits:
        triton_splitk.MAX_SPLITS = args.max_splits
    if args.tiny_block_m:
        triton_linear.TINY_BLOCK_M = triton_moe.TINY_BLOCK_M = args.tiny_block_m
    choose_kernels(args)
    b = Bench(args)
    plan: list[tuple[str, Callable[[], Any], float]] = [
        ("env", b.env, 0),
        ("limits", b.limits, 30),
        ("build", b.build, 20),
        ("decode", b.decode, 40),
        ("prefill", b.prefill, 30),
        ("prefill_probe", b.prefill_probe, 40),
        ("gates", b.gates, 60),
        ("transformers", b.transformers, 60),
        ("profile", b.profile, 20),
        ("census", b.census, 30),
        ("round_path", b.round_path, 30),
        ("rounds", b.rounds, 30),
        ("other_shape", b.other_shape, 90),
    ]
    run_sections(b, plan, ("limits", "profile", "census", "round_path", "other_shape"))


if __name__ == "__main__":
    main()
