"""gemma4 under tensor and expert parallel at --tp 2 with gloo on the CPU (fp32).

- the plan: q/o by heads, k/v by each layer's KV heads (sliding 2 -> one a rank; full 1 ->
  replicated), the dense MLP by channels, the stacked experts by expert, the vocabulary; a rank's
  pages and rings hold its KV heads; refusals name the config field; the dummy draws a rank's
  shard;
- passes: each rank loads its shard of the tiny transformers checkpoints (a26b_style: k_eq_v and
  the MoE; e_style: per-layer embeddings, KV sharing, a double-wide MLP; causal_lm: v_proj on full
  layers and an untied lm_head): logits match one rank's within the parity tolerance, greedy
  tokens are equal, and the pass-level gates hold at --tp 2 (concurrent == solo, resumed ==
  fresh, shuffled pages, poisoned pages);
- the engine: LLM(tp=2) on the demo checkpoint, rank 0 here and a follower it starts: tokens
  equal to one rank's, concurrent == solo, and pages == windows with poison and resumed == fresh
  through the prompt store.

Ranks of the passes test run as subprocesses of this file (`python test_gemma4_tp.py RANK PORT
...`), one launch for all checkpoints.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the GPU path on the CPU (ranks inherit it)

import pytest  # noqa: E402
import torch  # noqa: E402

from tensorfold import conformance, testing  # noqa: E402
from tensorfold.engine.runner import ModelRunner  # noqa: E402
from tensorfold.family import Shard, ShardRefused  # noqa: E402
from tensorfold.family.checkpoint import Checkpoint  # noqa: E402
from tensorfold.family.forward_pass import StreamRows  # noqa: E402
from tensorfold.ops import gpu, parallel  # noqa: E402
from tensorfold_gemma4 import shards  # noqa: E402
from tensorfold_gemma4.config import Gemma4Config  # noqa: E402
from tensorfold_gemma4.demo import build_demo  # noqa: E402
from tensorfold_gemma4.hooks import HOOKS  # noqa: E402
from tensorfold_gemma4.model import load  # noqa: E402

GREEDY_STEPS = 6
TOLERANCE = 1e-4  # fp32 logits, TP=2 against TP=1 (sums in another order)
GATED = ("a26b_style", "e_style")  # causal_lm: logits and tokens only
GPU_ROWS = 12  # the GPU path's prompt (past e_style's window of 8), then a decode row
GPU_CHECKED = "e_style"  # the MoE, k_eq_v, KV sharing and per-layer inputs (interpreted: slow)


def tiny_prompt() -> list[int]:
    gen = torch.Generator().manual_seed(1234)  # conftest's prompt
    return torch.randint(3, 256, (600,), generator=gen).tolist()


# -- the plan, without processes ----------------------------------------------------------------


def test_the_plan_cuts_heads_experts_and_vocabulary_and_keeps_the_rest_whole(tiny_paths):
    ckpt = Checkpoint.open(tiny_paths["a26b_style"])
    cfg = Gemma4Config.from_dict(ckpt.config)
    plan = shards.plan(cfg, "float32", 2)
    ckpt.set_shard(Shard(1, 2, plan))
    p = "model.language_model.layers"
    # 4 heads of 16 (sliding) and 32 (full); sliding layers 2 KV heads, full ones 1 (k_eq_v)
    assert ckpt.local_shape(f"{p}.0.self_attn.q_proj.weight") == (2 * 16, 64)
    assert ckpt.local_shape(f"{p}.2.self_attn.q_proj.weight") == (2 * 32, 64)
    assert ckpt.local_shape(f"{p}.0.self_attn.k_proj.weight") == (16, 64)
    assert ckpt.local_shape(f"{p}.2.self_attn.k_proj.weight") == (32, 64)  # replicated
    assert ckpt.local_shape(f"{p}.2.self_attn.o_proj.weight") == (64, 2 * 32)
    assert ckpt.local_shape(f"{p}.0.mlp.gate_proj.weight") == (64, 64)
    assert ckpt.local_shape(f"{p}.0.mlp.down_proj.weight") == (64, 64)
    assert ckpt.local_shape(f"{p}.0.experts.gate_up_proj") == (3, 48, 64)
    assert ckpt.local_shape(f"{p}.0.experts.down_proj") == (3, 64, 24)
    for whole in (
        "0.router.proj.weight",
        "0.router.per_expert_scale",
        "0.self_attn.q_norm.weight",
        "0.layer_scalar",
        "0.post_feedforward_layernorm_2.weight",
    ):
        assert ckpt.local_shape(f"{p}.{whole}") == ckpt.shape(f"{p}.{whole}")
    # a rank's state: sliding rings [W-1, 1, 16], full pages [1, 32] (its one KV head)
    assert {s.shape for s in plan.layout.fixed} == {(99, 1, 16)}
    assert {r.shape for r in plan.layout.paged} == {(1, 32)}
    whole = load(Checkpoint.open(tiny_paths["a26b_style"]), "cpu", "float32")
    assert shards.state_layout(cfg, "float32") == whole.layout  # one rank: as before
    # e_style: reuse layers hold no state, the store layers' layout is their readers'
    e = Gemma4Config.from_dict(Checkpoint.open(tiny_paths["e_style"]).config)
    names = [s.name for s in shards.state_layout(e, "float32", 2).fixed]
    assert names == ["L0.sk", "L0.sv", "L2.sk", "L2.sv"]
    # causal_lm: an untied lm_head read as this rank's vocabulary
    causal = Checkpoint.open(tiny_paths["causal_lm"])
    causal.set_shard(Shard(0, 2, shards.plan(Gemma4Config.from_dict(causal.config), "float32", 2)))
    assert causal.local_shape("lm_head.weight") == (128, 64)
    assert causal.local_shape("model.layers.1.self_attn.v_proj.weight") == (32, 64)
    # Gemma-4-26B-A4B: 8 sliding KV heads, 2 full ones (replicated beyond 2 ranks), 128 experts
    from tensorfold_gemma4.dummy import SHAPES

    for world, sliding, full in ((2, 4, 1), (8, 1, 1)):
        layout = shards.plan(SHAPES["Gemma-4-26B-A4B"], "bfloat16", world).layout
        assert {s.shape for s in layout.fixed} == {(1023, sliding, 256)}
        assert {r.shape for r in layout.paged} == {(full, 512)}


def test_refusals_name_the_config_field(tiny_paths):
    raw = Checkpoint.open(tiny_paths["a26b_style"]).config
    text = raw["text_config"]

    def refused(world: int, **change) -> str:
        cfg = Gemma4Config.from_dict({**raw, "text_config": {**text, **change}})
        with pytest.raises(ShardRefused) as info:
            shards.plan(cfg, "float32", world)
        return str(info.value)

    assert "num_attention_heads=4" in refused(3)
    assert "num_key_value_heads" in refused(
        4, num_attention_heads=12, num_key_value_heads=3, num_global_key_value_heads=2
    )
    full = {str(i): {"head_dim": 32, "num_key_value_heads": 3} for i in (2, 5)}
    assert "layer 2 (full_attention) has 3 KV heads (per_layer_config" in refused(
        4, num_attention_heads=12, num_key_value_heads=4, per_layer_config=full
    )
    assert "num_experts=6" in refused(4)
    assert "intermediate_size=129" in refused(2, intermediate_size=129)


def test_the_dummy_draws_a_ranks_shard(tiny_paths):
    from tensorfold_gemma4.dummy import dummy_weights

    cfg = Gemma4Config.from_dict(Checkpoint.open(tiny_paths["e_style"]).config)
    whole = dummy_weights(cfg, "cpu", torch.float32)
    ranks = []
    try:
        for rank in range(2):
            parallel.set_group(parallel.Group(rank, 2))
            ranks.append(dummy_weights(cfg, "cpu", torch.float32))
            from tensorfold_gemma4.model import Gemma4Model

            model = Gemma4Model(cfg, ranks[-1], "cpu", torch.float32)
            assert model.layout == shards.state_layout(cfg, "float32", 2)
    finally:
        parallel.set_group(None)
    a, b = ranks
    assert torch.equal(a.embed, whole.embed) and torch.equal(a.embed, b.embed)
    assert torch.equal(a.lm_head, a.embed[:128]) and torch.equal(b.lm_head, b.embed[128:])
    layer = a.layers[0]
    assert layer.attention.q.shape == (2 * 16, 64) and layer.attention.k.shape == (16, 64)
    assert a.layers[1].attention.k.shape == (32, 64)  # the full layer's one KV head, replicated
    assert layer.mlp.gate.shape == (64, 64) and a.layers[5].mlp.down.shape == (64, 128)
    assert layer.moe.gate_up.shape == (4, 64, 64) and (
        layer.moe.first_expert,
        b.layers[0].moe.first_expert,
    ) == (0, 4)
    assert torch.equal(layer.moe.router, b.layers[0].moe.router)
    assert not torch.equal(layer.attention.q, b.layers[0].attention.q)
    assert torch.equal(a.ple_embed, b.ple_embed)  # replicated: alike on every rank


# -- passes on the tiny checkpoints, one subprocess a rank ------------------------------------


def gpu_path(model, prompt: list[int]) -> torch.Tensor:
    """The GPU (Triton) path on the CPU: logits of GPU_ROWS prompt rows, then of a greedy decode
    row, [GPU_ROWS + 1, V]."""
    gpu.set_triton(True, on_cpu=True)
    try:
        runner = ModelRunner(model, num_pages=1, num_slots=1, page_rows=512)
        tokens = prompt[:GPU_ROWS]
        rows = runner.run([StreamRows(0, 0, tokens, [0], "all")])
        nxt = int(rows[-1][-1].argmax())
        rows += runner.run([StreamRows(0, GPU_ROWS, [nxt], [0], "last")])
        return torch.cat(rows)
    finally:
        gpu.set_triton(True, on_cpu=False)


def passes_worker(rank: int, port: int, out: str, *paths: str) -> None:
    """One rank, for each checkpoint: its shard, the logits and greedy tokens, and (GATED
    shapes) the pass-level gates at --tp 2."""
    testing.join_gloo(rank, port)
    prompt = tiny_prompt()
    got = {}
    for path in paths:
        model = testing.open_shard(path, rank, HOOKS, load)
        make_runner = testing.runner_factory(model)
        got[path] = testing.greedy(make_runner(), prompt, GREEDY_STEPS)
        if Path(path).name not in GATED:
            continue
        if Path(path).name == GPU_CHECKED:
            got["gpu", path] = gpu_path(model, prompt)
        # the gates at --tp 2: every rank runs the same checks, so their collectives meet
        prompts = [prompt[:300], prompt[:250], prompt[100:400]]
        testing.assert_streams_together_equal_alone(
            make_runner, model, prompts, (0, 1, 2), num_pages=6, max_rows=512
        )
        tokens = prompt[:300]
        one = testing.run_on_pages(model, tokens, [0], 512, [0, len(tokens)])
        resumed = testing.run_on_pages(model, tokens, [0], 512, [0, 7, 150, 299, len(tokens)])
        assert torch.equal(one, resumed)  # resumed == fresh: cut anywhere, the same bits
        testing.assert_shuffled_pages_change_nothing(model, tokens, [0, 130, len(tokens)])
        testing.assert_poisoned_pages_change_nothing(make_runner, prompt)
    if rank == 0:
        torch.save(got, out)
    parallel.set_group(None)
    torch.distributed.destroy_process_group()


def test_shards_give_one_ranks_logits_and_tokens_and_keep_the_gates(tiny_paths, tmp_path):
    out = tmp_path / "out.pt"
    paths = [str(tiny_paths[name]) for name in ("a26b_style", "e_style", "causal_lm")]
    testing.run_ranks(__file__, str(out), *paths)
    got = torch.load(out)
    prompt = tiny_prompt()
    for path in paths:
        model = load(Checkpoint.open(path), "cpu", "float32")
        logits, tokens = testing.greedy(
            ModelRunner(model, num_pages=8, num_slots=4), prompt, GREEDY_STEPS
        )
        torch.testing.assert_close(got[path][0], logits, rtol=0, atol=TOLERANCE)
        assert got[path][1] == tokens, path
        if Path(path).name == GPU_CHECKED:  # the GPU path, shard-aware alike
            one = gpu_path(model, prompt)
            torch.testing.assert_close(got["gpu", path], one, rtol=0, atol=TOLERANCE)
            assert torch.equal(got["gpu", path].argmax(-1), one.argmax(-1))


# -- the engine: LLM(tp=2) here as rank 0, with the follower it starts ------------------------


class TestEngineGatesAtTp(conformance.EngineGatesAtTp):
    # resumed == fresh past the demo's 128-row sliding window: the kept rings carry the resume
    family, build_demo = "gemma4", build_demo
    ids, lengths = (13, 700), (9, 200, 600)


if __name__ == "__main__":  # a rank of the passes test: python test_gemma4_tp.py RANK PORT ...
    rank_, port_, *rest = sys.argv[1:]
    passes_worker(int(rank_), int(port_), *rest)
