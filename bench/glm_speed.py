"""glm5_next speed on one GPU, in one run (docs/performance.md records the figures).

The model at GLM-5.3-Flash-8L's shape (GLM-5.3-Flash's widths, 8 layers: 6 KDA, 2 MLA; 3 dense,
5 MoE; ~76 GB) with dummy bf16 weights (tensorfold_glm.dummy), through `tensorfold.lanes.Lanes`
and a runner (decode rounds under CUDA graphs), not the server: decode tokens/s at 1, 8 and 64
streams, prefill tokens/s and time to first token for 2k, 8k and 32k prompts, the copy-bandwidth
limit and the fraction of it; the exactness gates in bf16 (concurrent == solo at 1, 8 and 64
streams, pages == windows, poisoned == clean); what fla-core's chunk_kda would cost or save
against the fused_recurrent_kda the serving path uses (times at 2k/8k/32k on one layer's shape,
and whether its bits hold packed and split); transformers 5.23.0 on the same weights; then,
with our model freed, resumed == fresh through the prompt store (a dummy-weight engine).
Writes results.json, log.txt and summary.txt to --out. Sections record their traceback and go on.

    python bench/glm_speed.py --out $OUT --commit $(git rev-parse --short HEAD)
    python bench/glm_speed.py --smoke   # the whole script on the CPU, tiny, Triton interpreted
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import engine_runs  # noqa: E402
from bench.engine_sections import PAGE_ROWS, EngineSections  # noqa: E402
from bench.model_bytes import address, experts_read, is_weight, kv_bytes, nbytes  # noqa: E402
from bench.report import compare, short  # noqa: E402
from bench.sections import sync  # noqa: E402
from bench.speed_main import choose_kernels, run_sections, speed_arguments  # noqa: E402
from tensorfold.engine.runner import ModelRunner  # noqa: E402
from tensorfold_glm.config import GlmConfig  # noqa: E402
from tensorfold_glm.dummy import SHAPES, build_dummy  # noqa: E402
from tensorfold_glm.weights import MoeWeights  # noqa: E402

SMOKE_CONFIG = dict(  # 4 layers: KDA x3 then MLA; 3 dense then MoE
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    index_head_dim=16,
    index_n_heads=16,
    index_topk=16,
    index_kpool=4,
    linear_num_heads=2,
    linear_head_dim=16,
    max_position_embeddings=8192,
)


def _tensors(obj, found: dict[int, Any]) -> dict[int, Any]:
    if is_weight(obj):  # a tensor or an fp8 weight, by where its values start
        found[address(obj)] = obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _tensors(x, found)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            _tensors(getattr(obj, name), found)
    return found


def step_bytes(model) -> dict[str, Any]:
    """Weight bytes a decode step must read: all but the embedding table (one row) and unused
    experts; top-k experts a MoE layer for one stream, all of them at most."""
    cfg, w = model.cfg, model.weights
    size = lambda ts: sum(nbytes(t) for t in ts)  # noqa: E731
    common = size([w.lm_head, w.final_norm])
    expert, moe_layers = 0, 0
    for layer in w.layers:
        held = _tensors(layer, {})
        if isinstance(layer.ffn, MoeWeights):
            experts = _tensors(layer.ffn.experts, {})
            expert = size(experts.values()) // cfg.n_routed_experts
            for p in experts:
                held.pop(p)
            moe_layers += 1
        common += size(held.values())
    total = size(_tensors(w, {}).values())
    return experts_read(
        common, expert, moe_layers, cfg.n_routed_experts, cfg.num_experts_per_tok, total
    )


class Bench(EngineSections):
    # the interpreter runs every kernel of this model slowly: smaller CPU runs
    SMOKE = dict(
        new=3, prompt=16, streams=(1, 2), prefill=(40, 100), gate_top=40, gate_new=3, levels=(1, 4)
    )

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        self.smoke = args.smoke

    def config(self) -> GlmConfig:
        if self.smoke:
            return GlmConfig.from_dict(SMOKE_CONFIG, "smoke")
        return SHAPES[self.args.shape]

    # -- sections: each returns a JSON-able dict ----------------------------------------------

    def env(self) -> dict[str, Any]:
        import triton

        info: dict[str, Any] = {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "commit": self.args.commit,
        }
        for pkg in ("fla", "transformers"):
            if importlib.util.find_spec(pkg) is not None:
                from importlib.metadata import PackageNotFoundError, version

                try:
                    info[pkg] = version("fla-core" if pkg == "fla" else pkg)
                except PackageNotFoundError:
                    info[pkg] = "importable"
        if self.device == "cuda":
            p = torch.cuda.get_device_properties(0)
            info.update(gpu=p.name, sms=p.multi_processor_count, mem_gib=p.total_memory / 2**30)
        return info

    def limits(self) -> dict[str, Any]:
        from bench import limits

        return {"copy": limits.copy_bandwidth()}

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
        return {
            "quantization": self.args.quantization,
            "shape": "smoke" if self.smoke else self.args.shape,
            "build_s": time.perf_counter() - a,
            **step_bytes(self.model),
            "fixed_state_bytes_per_stream": self.model.layout.fixed_bytes,
        }

    def decode(self) -> dict[str, Any]:
        """The shared decode, with a stream's bytes a step beside the weights: its cache rows at
        context 100, and every KDA state and conv tail read and written."""
        res = super().decode()
        layout = self.model.layout
        kv = 2 * layout.fixed_bytes + kv_bytes(self.model, 100) - layout.fixed_bytes
        for name, d in res.items():
            if name != "streams1_eager":
                d["kv_bytes_per_stream"] = kv
        return res

    def kda_cost(self) -> dict[str, Any]:
        """fla-core on one KDA layer's shape: chunk_kda against fused_recurrent_kda (what the
        serving path runs for every row), and chunk_kda's bits packed and split."""
        if self.device != "cuda" or importlib.util.find_spec("fla") is None:
            return {
                "skipped": "fla-core needs the GPU (and is not installed here): the KDA rows "
                "ran the torch recurrence"
            }
        from fla.ops.kda import chunk_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        cfg = self.config()
        h, d = cfg.linear_num_heads, cfg.linear_head_dim
        gen = torch.Generator(device="cuda").manual_seed(0)

        def inputs(t: int):
            r = lambda *s, std=1.0: torch.randn(*s, device="cuda", generator=gen) * std  # noqa
            bf = torch.bfloat16
            return dict(
                q=r(1, t, h, d).to(bf),
                k=r(1, t, h, d).to(bf),
                v=r(1, t, h, d).to(bf),
                g=r(1, t, h, d).to(bf),
                beta=torch.sigmoid(r(1, t, h)).to(bf),
            )

        a_log = torch.log(torch.linspace(1, 16, h, device="cuda"))
        dt = torch.randn(h * d, device="cuda", generator=gen) * 0.5
        gate = dict(
            A_log=a_log,
            dt_bias=dt,
            use_gate_in_kernel=True,
            lower_bound=-5.0,
            use_qk_l2norm_in_kernel=True,
            scale=d**-0.5,
        )

        def chunk(x, state=None, cu=None):
            o, final = chunk_kda(
                **x, initial_state=state, output_final_state=True, cu_seqlens=cu, **gate
            )
            return o, final

        def recurrent(x, state):
            return fused_recurrent_kda_fwd(
                **x, initial_state=state, output_final_state=True, inplace_final_state=False, **gate
            )

        def timed(fn) -> float:
            fn()
            sync("cuda")
            a = time.perf_counter()
            for _ in range(3):
                fn()
            sync("cuda")
            return 1e3 * (time.perf_counter() - a) / 3

        res: dict[str, Any] = {"shape": {"heads": h, "head_dim": d}}
        self.results["kda_cost"] = res  # kept as it fills, should the call run out of time
        # bits: packed with another sequence vs alone; split at a 64-multiple vs whole
        x, y = inputs(3000), inputs(1000)
        zero2 = torch.zeros(2, h, d, d, device="cuda")
        o_alone, s_alone = chunk(x, zero2[:1])
        both = {k: torch.cat((x[k], y[k]), 1) for k in x}
        cu = torch.tensor([0, 3000, 4000], device="cuda", dtype=torch.long)
        o_packed, s_packed = chunk(both, zero2, cu)
        res["chunk_packed_equals_alone"] = bool(
            torch.equal(o_packed[:, :3000], o_alone) and torch.equal(s_packed[0], s_alone[0])
        )
        cut = 1024
        first = {k: v[:, :cut].contiguous() for k, v in x.items()}
        rest = {k: v[:, cut:].contiguous() for k, v in x.items()}
        o1, s1 = chunk(first, zero2[:1])
        o2, s2 = chunk(rest, s1)
        res["chunk_split_at_1024_equals_whole"] = bool(
            torch.equal(torch.cat((o1, o2), 1), o_alone) and torch.equal(s2, s_alone)
        )
        res["chunk_vs_recurrent_rel"] = float(
            (o_alone.float() - recurrent(x, zero2[:1])[0].float()).norm() / o_alone.float().norm()
        )
        r1 = recurrent(first, zero2[:1])
        r2 = recurrent(rest, r1[1])
        rw = recurrent(x, zero2[:1])
        res["recurrent_split_equals_whole"] = bool(
            torch.equal(torch.cat((r1[0], r2[0]), 1), rw[0]) and torch.equal(r2[1], rw[1])
        )
        self.save()
        for t in (2048, 8192, 32768):
            x = inputs(t)
            zero = torch.zeros(1, h, d, d, device="cuda")
            res[f"rows{t}"] = {
                "chunk_kda_ms": timed(lambda: chunk(x, zero)),
                "fused_recurrent_kda_ms": timed(lambda: recurrent(x, zero)),
            }
            self.save()
        return res

    def transformers(self) -> dict[str, Any]:
        """transformers 5.23.0 on our weights (sharing their storage): decode and prefill rates,
        and logits against ours in bf16. Which KDA kernels it used: from its CUDA kernels."""
        from bench import glm_hf

        hf = glm_hf.build_hf(self.model)
        vocab = self.model.vocab_size
        res: dict[str, Any] = {"kda_kernels_importable": glm_hf.kda_kernels()}
        dev = self.device
        prompt = engine_runs.random_prompts(1, 64, vocab, seed=99)[0]
        ids = torch.tensor([prompt], device=dev)
        steps = 4 if self.smoke else 8
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=2, do_sample=False)  # warm
            sync(dev)
            a = time.perf_counter()
            out = hf.generate(ids, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
            sync(dev)
            res["streams1_generate_tokens_per_s"] = steps / (time.perf_counter() - a)
            theirs = out[0, len(prompt) :].tolist()
            for n in (2048,) if not self.smoke else (40,):
                p = torch.tensor(engine_runs.random_prompts(1, n, vocab, seed=n), device=dev)
                sync(dev)
                a = time.perf_counter()
                hf(input_ids=p, logits_to_keep=1)
                sync(dev)
                res[f"prefill{n}_tokens_per_s"] = n / (time.perf_counter() - a)
            if dev == "cuda":
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    hf(input_ids=ids)
                    sync(dev)
                names = {e.key for e in prof.key_averages()}
                res["kda_kernels_seen"] = sorted(
                    k[:80]
                    for k in names
                    if "kda" in k.lower() or "delta" in k.lower() or "conv1d" in k.lower()
                )[:20]
        ours = (
            engine_runs.run_requests(
                self.runner(1, window=1024), [prompt], steps, lanes=1, window=1024
            )
            .outcomes[0]
            .tokens
        )
        res["greedy_tokens_agree_for"] = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours)
        )
        seq = prompt + ours
        from tensorfold.family.forward_pass import StreamRows

        runner = ModelRunner(self.model, num_pages=2, num_slots=1, page_rows=PAGE_ROWS)
        (ours16,) = runner.run([StreamRows(0, 0, seq, [0, 1], "all")])
        with torch.inference_mode():
            theirs16 = hf(input_ids=torch.tensor([seq], device=dev)).logits[0].float()
        res["bf16_ours_vs_transformers"] = compare(ours16, theirs16)
        del hf
        return res

    def fp32_parity(self) -> dict[str, Any]:
        """Ours against transformers, both in fp32 on the GPU, at GLM-5.3-Flash's widths with 4
        layers (KDA + dense at 0-2, MLA with the indexer + MoE at 3; 36 GB): what the bf16
        comparison cannot show with random weights, whose flat logits let bf16 rounding flip
        close argmaxes. (Its own process: the 8-layer bench model is not built.)"""
        from bench import glm_hf
        from tensorfold.family.forward_pass import StreamRows

        cfg = (
            self.config()
            if self.smoke
            else GlmConfig.from_dict({"num_hidden_layers": 4}, "GLM-5.3-Flash-4L")
        )
        model = build_dummy(cfg, self.device, torch.float32, seed=0)
        res: dict[str, Any] = {
            "layer_types": list(cfg.layer_types),
            "mlp_layer_types": list(cfg.mlp_layer_types),
        }
        prompt = engine_runs.random_prompts(1, 64 if self.smoke else 2100, cfg.vocab_size, seed=99)[
            0
        ]
        pages = -(-len(prompt) // PAGE_ROWS)
        runner = ModelRunner(model, num_pages=pages, num_slots=1, page_rows=PAGE_ROWS)
        (ours,) = runner.run([StreamRows(0, 0, prompt, list(range(pages)), "all")])
        hf = glm_hf.build_hf(model)
        with torch.inference_mode():
            theirs = hf(input_ids=torch.tensor([prompt], device=self.device)).logits[0].float()
        res["positions"] = len(prompt)
        res["fp32_ours_vs_transformers"] = compare(ours.float(), theirs)
        tail = slice(2048, None) if len(prompt) > 2048 else slice(None)
        res["fp32_past_2048_sparse_selection"] = compare(ours[tail].float(), theirs[tail])
        del hf, runner, model
        gc.collect()
        return res

    def resumed(self) -> dict[str, Any]:
        """resumed == fresh through the prompt store, on an engine loading the same dummy
        weights (our bench model is freed first: one 76 GB model at a time)."""
        from tensorfold import testing
        from tensorfold.engine.sampling import SamplingParams
        from tensorfold.llm import LLM
        from tensorfold_glm import triton_kda  # noqa: F401  (the kernels the engine runs)

        was = weakref.ref(self.model) if self.model is not None else None
        self.model = None
        gc.collect()  # the bench model's 78 GB must be gone before an engine loads its own
        if self.device == "cuda":
            torch.cuda.empty_cache()
        held = torch.cuda.memory_allocated() if self.device == "cuda" else 0
        if was is not None and was() is not None:
            holders = sorted({type(r).__name__ for r in gc.get_referrers(was())})
            raise RuntimeError(f"the bench model is still held (by {holders}): {held} bytes")
        folder = self.dummy_folder()
        vocab = self.config().vocab_size
        g = torch.Generator().manual_seed(5)
        n_first = 3000 if not self.smoke else 150
        first = torch.randint(20, vocab, (n_first,), generator=g).tolist()

        def tail(s: int) -> list[int]:
            return torch.randint(
                20, vocab, (5,), generator=torch.Generator().manual_seed(s)
            ).tolist()

        marks = [48, 50, 64, 208] + ([2048, 2100] if not self.smoke else [])
        follow = {
            "past 208": first[:230] + tail(1),
            "past 64": first[:70] + tail(2),
            "at 49": first[:49] + tail(3),
            "whole": first + tail(4),
        }
        if not self.smoke:
            follow["past 2048"] = first[:2600] + tail(5)
        params = SamplingParams(temperature=0, max_tokens=8)
        submit = lambda llm, ids, marks: testing.submit_with_marks(  # noqa: E731
            llm, ids, marks, params, timeout_s=600
        )
        flags = dict(
            device=self.device,
            dtype="bfloat16",
            load_format="dummy",
            parallel=2,
            context=4096,
            prompt_cache_gib=8 if not self.smoke else 0.05,
        )
        if self.smoke:
            flags.update(memory_limit_gib=0.5)
        out: dict[int, dict[str, Any]] = {}
        for share in (0, 16):
            llm = LLM(family="glm5_next", model=folder, kv_share=share, **flags)
            try:
                got = {"first": submit(llm, first, marks)}
                for name, ids in follow.items():
                    got[name] = submit(llm, ids, [])
                # a chat's next turn: the first prompt, its (decoded) reply, a new user turn
                reply = got["first"][0]
                got["next turn"] = submit(llm, first + reply + tail(6), [])
                out[share] = got
            finally:
                testing.close_even(llm)
                del llm  # its weights and pool go before the next engine loads
                gc.collect()
                if self.device == "cuda":
                    torch.cuda.empty_cache()
        res: dict[str, Any] = {}
        for name in out[0]:
            tokens, cached = out[16][name]
            res[name] = {"resumed_from": cached, "equal_to_fresh": tokens == out[0][name][0]}
        res["all_equal"] = all(v["equal_to_fresh"] for v in res.values() if isinstance(v, dict))
        res["bytes_held_before_the_engines"] = held
        shutil.rmtree(folder, ignore_errors=True)
        return res

    def dummy_folder(self) -> Path:
        """config.json at the bench's shape, with the demo checkpoint's tokenizer files."""
        from bench.glm_hf import text_config
        from tensorfold_glm.demo import build_demo

        demo = build_demo(Path(tempfile.mkdtemp()))
        folder = Path(tempfile.mkdtemp())
        for f in demo.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, folder / f.name)
        config = json.loads((demo / "config.json").read_text())
        config["text_config"].update(text_config(self.config()))
        config["text_config"]["max_position_embeddings"] = self.config().max_position_embeddings
        config["dtype"] = "bfloat16"
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        return folder


def main() -> None:
    ap = speed_arguments(__doc__.splitlines()[0], "GLM-5.3-Flash-8L", SHAPES, 560.0)
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        torch.set_num_threads(1)
    choose_kernels(args)
    b = Bench(args)
    want = set(args.sections.split(",")) if args.sections != "all" else None
    plan: list[tuple[str, Callable[[], Any], float]] = [
        ("env", b.env, 0),
        ("limits", b.limits, 30),
        ("build", b.build, 30),
        ("decode", b.decode, 60),
        ("gates", b.gates, 90),
        ("prefill", b.prefill, 60),
        ("kda_cost", b.kda_cost, 30),
        ("transformers", b.transformers, 60),
        ("resumed", b.resumed, 90),
        ("fp32_parity", b.fp32_parity, 60),
        ("profile", b.profile, 30),
        ("census", b.census, 30),
        ("round_path", b.round_path, 30),
    ]
    # resumed and kda_cost build their own: the bench model's 78 GB would only be in the way
    uses_model = want is None or bool(
        want & {"decode", "gates", "prefill", "transformers", "profile", "census", "round_path"}
    )
    run_sections(
        b,
        plan,
        ("limits", "profile", "census", "round_path"),
        skip=() if uses_model else ("build",),
        extra=[
            f"{name}: {short(b.results.get(name, {}))}"
            for name in ("kda_cost", "resumed", "fp32_parity", "gates")
        ],
    )


if __name__ == "__main__":
    main()
