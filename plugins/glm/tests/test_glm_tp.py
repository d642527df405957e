"""glm5_next under tensor and expert parallel at --tp 2 with gloo on the CPU (fp32).

- the plan: which tensors split and how, a rank's state layout, refusals naming the config field;
  the dummy loader draws a rank's shard (replicated tensors alike on every rank);
- passes: each rank loads its shard of the tiny transformers checkpoints (KDA heads with their
  q/k/v convolutions, MLA heads, FFN columns, experts across ranks, the vocabulary; the latent
  and the indexer whole); logits match one rank's within the parity tolerance, greedy tokens
  are equal, and the pass-level gates hold at --tp 2 (concurrent == solo, resumed == fresh,
  pages == windows, poisoned == clean) with the sparse pool selection active; and the GPU path
  (the Triton kernels, interpreted on the CPU) on a smaller checkpoint gives one rank's logits;
- the engine: LLM(tp=2) on the demo checkpoint, rank 0 here and a follower it starts: tokens
  equal to one rank's, and the gates through the lanes and the prompt store.

Ranks run as subprocesses of this file (`python test_glm_tp.py RANK PORT ...`) on a free
port.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tensorfold import conformance, testing
from tensorfold.engine.runner import ModelRunner
from tensorfold.family import Shard, ShardRefused, StateSpec
from tensorfold.family.checkpoint import Checkpoint
from tensorfold.ops import parallel
from tensorfold_glm import shards
from tensorfold_glm.config import GlmConfig
from tensorfold_glm.demo import build_demo
from tensorfold_glm.hooks import HOOKS
from tensorfold_glm.model import load

PROMPT_LEN = 260  # past the sparse point of both tiny shapes (12 and 48 rows); crosses 64-row pages
GREEDY_STEPS = 6
WORKER_TIMEOUT_S = 150
TOLERANCE = 1e-4  # fp32: the ranks' partial sums round differently from one rank's sums


def tiny_prompt() -> list[int]:
    gen = torch.Generator().manual_seed(1234)  # the tiny fixture's prompt, cut short
    return torch.randint(3, 250, (PROMPT_LEN,), generator=gen).tolist()


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo(tmp_path_factory.mktemp("demo"))


# -- the plan, without processes ----------------------------------------------------------------


def test_the_plan_cuts_heads_experts_and_columns_and_keeps_the_rest_whole(tiny_paths):
    ckpt = Checkpoint.open(tiny_paths["glm_tiny"])
    cfg = GlmConfig.from_dict(ckpt.config)  # KDA layers 0, 3; MLA 1, 2; dense layer 0
    plan = shards.plan(cfg, "float32", 2)
    ckpt.set_shard(Shard(1, 2, plan))
    p = "model.language_model.layers"
    whole = {name: ckpt.shape(name) for name in ckpt.tensor_names()}
    half_rows = [
        f"{p}.0.self_attn.{x}"
        for x in (
            "q_proj.weight",
            "k_proj.weight",
            "v_proj.weight",
            "q_conv1d.weight",
            "v_conv1d.weight",
            "f_b_proj.weight",
            "g_b_proj.weight",
            "dt_bias",
            "A_log",
            "b_proj.weight",
        )
    ]
    half_rows += [
        f"{p}.1.self_attn.q_b_proj.weight",
        f"{p}.2.self_attn.kv_b_proj.weight",
        f"{p}.0.mlp.gate_proj.weight",
        f"{p}.1.mlp.shared_experts.up_proj.weight",
        "lm_head.weight",
    ]
    for name in half_rows:
        assert ckpt.local_shape(name) == (whole[name][0] // 2, *whole[name][1:]), name
    for name in (
        f"{p}.3.self_attn.o_proj.weight",
        f"{p}.1.self_attn.o_proj.weight",
        f"{p}.0.mlp.down_proj.weight",
        f"{p}.2.mlp.shared_experts.down_proj.weight",
    ):
        assert ckpt.local_shape(name) == (whole[name][0], whole[name][1] // 2), name
    for name in (
        f"{p}.0.self_attn.f_a_proj.weight",
        f"{p}.0.self_attn.o_norm.weight",
        f"{p}.1.self_attn.kv_a_proj_with_mqa.weight",
        f"{p}.1.self_attn.q_a_proj.weight",
        f"{p}.1.self_attn.indexer.wq_b.weight",
        f"{p}.1.self_attn.indexer.wk.weight",
        f"{p}.1.mlp.gate.weight",
        f"{p}.1.mlp.gate.e_score_correction_bias",
        f"{p}.1.hc_attn_fn",
        "model.language_model.embed_tokens.weight",
    ):
        assert ckpt.local_shape(name) == whole[name], name
    # experts 4..7 are rank 1's, read whole; rank 0's are not read here at all
    assert (
        ckpt.local_shape(f"{p}.1.mlp.experts.5.down_proj.weight")
        == whole[f"{p}.1.mlp.experts.5.down_proj.weight"]
    )
    assert ckpt.local_shape(f"{p}.1.mlp.experts.3.down_proj.weight") is None
    # a rank's state: its KDA heads and conv channels; the latent and indexer rows whole
    fixed = {s.name: s for s in plan.layout.fixed}
    assert fixed["L0.kda"] == StateSpec("L0.kda", (1, 16, 16), "float32", arena_taps=True)
    assert fixed["L0.conv"] == StateSpec("L0.conv", (3 * 16, 3), "float32")
    one = shards.state_layout(cfg, "float32")
    assert plan.layout.paged == one.paged
    model = load(ckpt, "cpu", "float32")  # no group here: the shapes alone
    moe = model.weights.layers[1].ffn
    assert len(moe.experts) == 4 and moe.first_expert == 4


def test_refusals_name_the_config_field(tiny_paths):
    cfg = GlmConfig.from_dict(Checkpoint.open(tiny_paths["glm_tiny"]).config)
    from dataclasses import replace

    four = replace(cfg, linear_num_heads=4)  # past the KDA heads, each field in turn
    cases = {
        "linear_num_heads=2": cfg,
        "num_attention_heads=6": replace(four, num_attention_heads=6, num_key_value_heads=6),
        "n_routed_experts=6": replace(four, n_routed_experts=6),
        "intermediate_size=130": replace(four, intermediate_size=130),
    }
    for field, c in cases.items():
        with pytest.raises(ShardRefused, match=f"glm5_next: {field} .* --tp 4"):
            shards.plan(c, "float32", 4)
    shards.plan(four, "float32", 4)  # everything divides


def test_the_dummy_draws_a_ranks_shard(tiny_paths):
    from tensorfold_glm.dummy import build_dummy, expert_stacks

    ckpt = Checkpoint.open(tiny_paths["glm_tiny"])
    cfg = GlmConfig.from_dict(ckpt.config)
    got = []
    try:
        for rank in range(2):
            parallel.set_group(parallel.Group(rank, 2))
            got.append(build_dummy(cfg, "cpu", torch.float32))
    finally:
        parallel.set_group(None)
    plan = shards.plan(cfg, "float32", 2)
    ckpt.set_shard(Shard(0, 2, plan))
    a, b = (m.weights for m in got)
    assert got[0].layout == plan.layout
    kda, mla = a.layers[0].mixer, a.layers[1].mixer
    p = "model.language_model.layers"
    assert kda.qkv.shape[0] == 3 * ckpt.local_shape(f"{p}.0.self_attn.q_proj.weight")[0]
    assert kda.b.shape == ckpt.local_shape(f"{p}.0.self_attn.b_proj.weight")
    assert kda.o.shape == ckpt.local_shape(f"{p}.0.self_attn.o_proj.weight")
    assert mla.q_b.shape == ckpt.local_shape(f"{p}.1.self_attn.q_b_proj.weight")
    assert mla.o.shape == ckpt.local_shape(f"{p}.1.self_attn.o_proj.weight")
    assert a.lm_head.shape == ckpt.local_shape("lm_head.weight")
    assert a.layers[0].ffn.down.shape == ckpt.local_shape(f"{p}.0.mlp.down_proj.weight")
    moe_a, moe_b = a.layers[1].ffn, b.layers[1].ffn
    assert (moe_a.first_expert, moe_b.first_expert, len(moe_a.experts)) == (0, 4, 4)
    gate_up, _ = expert_stacks(moe_b)  # the rank's experts are views of one stack
    assert torch.equal(gate_up[3], moe_b.experts[3].gate_up)
    # replicated tensors alike on both ranks; the slices are each rank's own
    for x, y in (
        (a.embed, b.embed),
        (mla.indexer.wq_b, b.layers[1].mixer.indexer.wq_b),
        (a.layers[2].attn_hc.fn, b.layers[2].attn_hc.fn),
        (moe_a.router, moe_b.router),
        (kda.f_a, b.layers[0].mixer.f_a),
    ):
        assert torch.equal(x, y)
    assert not torch.equal(kda.qkv, b.layers[0].mixer.qkv)


# -- passes on the tiny checkpoints, one subprocess a rank ------------------------------------


# the GPU path interpreted on the CPU is slow: a checkpoint as small as covers every layer kind
# (KDA, MLA with its indexer, a "shared" MLA layer, dense and MoE), two mHC streams, 3 Sinkhorn
# rounds, 4-row pools (sparse from row 12)
KERNEL_TEXT: dict = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=32,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=0,
    v_head_dim=16,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    layer_types=["linear_attention", "indexed_attention", "indexed_attention"],
    indexer_types=["full", "full", "shared"],
    mlp_layer_types=["dense", "sparse", "sparse"],
    index_topk=8,
    index_head_dim=16,
    index_n_heads=16,
    index_kpool=4,
    linear_num_heads=2,
    linear_head_dim=16,
    linear_conv_kernel_dim=4,
    hc_mult=2,
    hc_sinkhorn_iters=3,
    max_position_embeddings=1024,
)
KERNEL_PROMPT = list(range(3, 19))


def write_kernel_checkpoint(folder: Path) -> Path:
    import json

    from safetensors.torch import save_file

    from tensorfold_glm.demo import VISION_SHAPE
    from tensorfold_glm.demo_weights import build_weights

    folder.mkdir()
    vision = {**VISION_SHAPE, "out_hidden_size": KERNEL_TEXT["hidden_size"]}
    cfg = {"model_type": "glm5_next", "text_config": KERNEL_TEXT, "vision_config": vision}
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(build_weights(cfg), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def kernel_passes(model, make_runner) -> tuple[torch.Tensor, list[int]]:
    """Greedy through the Triton kernels: a prompt pass and a decode row."""
    from tensorfold.ops import gpu

    gpu.set_triton(True, on_cpu=True)
    try:
        return testing.greedy(make_runner(model=model), KERNEL_PROMPT, 2)
    finally:
        gpu.set_triton(True)


def passes_worker(rank: int, port: int, out: str, kernels: str, demo: str, *paths: str) -> None:
    """One rank, for each tiny checkpoint: its shard, the logits and greedy tokens, and the
    pass-level gates at --tp 2 (every rank runs the same checks, so their collectives meet);
    the demo's logits and tokens; then the GPU path on `kernels`."""
    import torch.distributed as dist

    testing.join_gloo(rank, port)
    prompt = tiny_prompt()
    n = len(prompt)
    got = {}
    for path in paths:
        model = testing.open_shard(path, rank, HOOKS, load)
        make_runner = testing.runner_factory(model)
        got[path] = testing.greedy(make_runner(), prompt, GREEDY_STEPS)
        prompts = [prompt[:200], prompt[:180], prompt[40:]]
        testing.assert_streams_together_equal_alone(
            make_runner, model, prompts, (0, 1, 2), num_pages=6, max_rows=512
        )
        # resumed == fresh, and pages == windows: cut anywhere, over 64-row pages, the same bits
        one = testing.run_on_pages(model, prompt, [0], 512, [0, n])
        resumed = testing.run_on_pages(model, prompt, [3, 0, 5, 1, 2], 64, [0, 37, 128, 129, n])
        assert torch.equal(one, resumed)
        testing.assert_poisoned_pages_change_nothing(make_runner, prompt)
    got[demo] = testing.greedy(
        make_runner(model=testing.open_shard(demo, rank, HOOKS, load)), prompt, GREEDY_STEPS
    )
    got[kernels] = kernel_passes(testing.open_shard(kernels, rank, HOOKS, load), make_runner)
    if rank == 0:
        torch.save(got, out)
    dist.destroy_process_group()


def test_shards_give_one_ranks_logits_and_tokens_and_keep_the_gates(tiny_paths, demo, tmp_path):
    """Both tiny shapes: glm_tiny (2 KDA heads, one a rank; 4-token pools, a "shared" indexer
    layer, expert groups) and glm_pools16 (MLA first with biases, 2 MLA heads, 4 KDA heads,
    a kernel-3 conv, two shared experts); the demo's logits and tokens; and the kernels'
    checkpoint through the GPU path, against one rank's CPU path (the kernels match it to fp32
    rounding at one rank)."""
    out = tmp_path / "out.pt"
    kernels = str(write_kernel_checkpoint(tmp_path / "kernels"))
    paths = [str(p) for p in tiny_paths.values()]
    testing.run_ranks(
        __file__,
        str(out),
        kernels,
        str(demo),
        *paths,
        timeout_s=WORKER_TIMEOUT_S,
        env={"TRITON_INTERPRET": "1"},
    )
    got = torch.load(out)
    for path, prompt, steps in [
        *((p, tiny_prompt(), GREEDY_STEPS) for p in [*paths, str(demo)]),
        (kernels, KERNEL_PROMPT, 2),
    ]:
        model = load(Checkpoint.open(path), "cpu", "float32")
        logits, tokens = testing.greedy(ModelRunner(model, num_pages=8, num_slots=4), prompt, steps)
        torch.testing.assert_close(got[path][0], logits, rtol=0, atol=TOLERANCE)
        assert got[path][1] == tokens, path


# -- the engine: LLM(tp=2) here as rank 0, with the follower it starts ------------------------


class TestEngineGatesAtTp(conformance.EngineGatesAtTp):
    family, build_demo = "glm5_next", build_demo
    # the demo selects 4 pools of 16: the longer prompts are past the sparse point
    ids, lengths, context, parallel = (20, 800), (9, 130, 300), 2048, 3
    first_turn, later_turn, min_cached = 120, 15, 100


if __name__ == "__main__":  # a rank of the tests above: python test_glm_tp.py RANK PORT ...
    rank_, port_, *rest = sys.argv[1:]
    passes_worker(int(rank_), int(port_), *rest)
