"""gemma4's assistant drafter (assistant.py) against transformers 5.23.0, in fp32 on tiny configs.

A KV-sharing target (the E-series layout: the drafter path of 5.23.0 needs one) and two tiny
assistants, one with the tied head and one with the centroid-masked head, are built with
transformers and saved. The reference drafts with its own
`SinglePositionMultiTokenCandidateGenerator` from the target's outputs; ours from the same hidden
state and shared K/V, or from our engine's pages and rings (assistant_kv.py) after the target ran
in our ModelRunner.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

import pytest
import torch

from tensorfold import conformance, testing
from tensorfold.config.settings import SettingsError
from tensorfold.engine.runner import ModelRunner, open_stream
from tensorfold.engine.sampling import SamplingParams
from tensorfold.family.checkpoint import Checkpoint
from tensorfold_gemma4.assistant import KVRows, load_assistant, store_layers
from tensorfold_gemma4.assistant_config import AssistantConfig
from tensorfold_gemma4.assistant_kv import gather_shared_kv
from tensorfold_gemma4.config import ConfigError
from tensorfold_gemma4.demo import build_demo
from tensorfold_gemma4.model import load

S, F = "sliding_attention", "full_attention"
WINDOW = 8
COMMON: dict[str, Any] = dict(
    vocab_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    sliding_window=WINDOW,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
    enable_moe_block=False,
)
TARGET = dict(
    COMMON,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    layer_types=[S, F, S, F],
    num_kv_shared_layers=2,  # layers 0 (sliding) and 1 (full) store, 2 and 3 reuse
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=256,
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
)
ASSISTANT_TEXT = dict(
    COMMON,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    layer_types=[S, S, F],
    hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=0,
)
HEADS = {"tied": {}, "centroids": dict(num_centroids=16, centroid_intermediate_top_k=4)}
TOL = 1e-4  # of the logits' largest magnitude


@contextlib.contextmanager
def all_reuse_layers() -> Iterator[None]:
    """transformers 5.23.0's Gemma4TextConfig.kv_sharing_modes raises when no layer of a type
    stores K/V, which is every assistant's config (all layers reuse the target's): it cannot
    build one without this. A config whose layers all reuse gets "reuse" throughout."""
    from transformers import Gemma4TextConfig

    plain = Gemma4TextConfig.kv_sharing_modes

    def modes(config: Any) -> list[str | None]:
        if config.num_kv_shared_layers == config.num_hidden_layers:
            return ["reuse"] * config.num_hidden_layers
        return plain.fget(config)

    with mock.patch.object(Gemma4TextConfig, "kv_sharing_modes", property(modes)):
        yield


def perturb(model: Any, seed: int) -> Any:
    """Norm weights and layer scalars away from their 1.0 initialisation (as conftest.py)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.7 + 0.3 * torch.rand(b.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The reference target and assistants (in memory) and ours loaded from their folders."""
    pytest.importorskip("transformers", reason="transformers 5.23.0 is the parity reference")
    from transformers import (
        Gemma4AssistantConfig,
        Gemma4AssistantForCausalLM,
        Gemma4ForCausalLM,
        Gemma4TextConfig,
    )

    root = tmp_path_factory.mktemp("gemma4_assistant")
    torch.manual_seed(0)
    target = perturb(Gemma4ForCausalLM(Gemma4TextConfig(**TARGET)), 10)
    target.save_pretrained(root / "target")
    ours = load(Checkpoint.open(root / "target"), "cpu", "float32")
    refs, drafters = {}, {}
    for seed, (head, extra) in enumerate(HEADS.items()):
        config = Gemma4AssistantConfig(
            text_config=dict(ASSISTANT_TEXT),
            backbone_hidden_size=TARGET["hidden_size"],
            use_ordered_embeddings=bool(extra),
            **extra,
        )
        torch.manual_seed(1 + seed)
        with all_reuse_layers():
            ref = perturb(Gemma4AssistantForCausalLM(config), 20 + seed)
        if extra:  # a random clustering of the vocabulary (the init leaves zeros)
            gen = torch.Generator().manual_seed(30)
            ref.masked_embedding.token_ordering.copy_(torch.randperm(256, generator=gen))
        ref.save_pretrained(root / head)
        refs[head] = ref
        drafters[head] = load_assistant(Checkpoint.open(root / head), ours)
    return {"target": target, "ours": ours, "refs": refs, "drafters": drafters, "root": root}


def prompt(n: int, seed: int = 5) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def target_outputs(target: Any, ids: list[int]) -> Any:
    with torch.no_grad():
        return target(
            input_ids=torch.tensor([ids]),
            output_hidden_states=True,
            return_shared_kv_states=True,
            use_cache=True,
        )


def reference_drafts(
    target: Any, assistant: Any, ids: list[int], k: int, out: Any = None
) -> tuple[list[int], torch.Tensor]:
    """transformers' k drafts after `ids` (their next token appended): the candidate generator
    exactly as generate() calls it after the target's prefill. Returns tokens, logits [k, V]."""
    from transformers import GenerationConfig
    from transformers.generation.candidate_generator import (
        SinglePositionMultiTokenCandidateGenerator,
    )

    out = out if out is not None else target_outputs(target, ids)
    x = int(out.logits[0, -1].argmax())
    assistant.generation_config.num_assistant_tokens = k
    generator = SinglePositionMultiTokenCandidateGenerator(
        assistant, target.get_input_embeddings(), GenerationConfig(max_length=1024)
    )
    seq = torch.tensor([ids + [x]])
    with torch.no_grad():
        candidates, logits = generator.get_candidates(
            seq,
            model_kwargs={"attention_mask": torch.ones_like(seq)},
            model_outputs=out,
            is_first_iteration=False,
            n_last_matches=0,
        )
    return candidates[0, len(ids) + 1 :].tolist(), logits[0].float()


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours - ref).abs().max().item()
    assert err <= TOL * ref.abs().max().item(), f"max |ours - ref| {err:.3g}"


@pytest.mark.parametrize("head", HEADS)
def test_drafts_match_the_candidate_generator(pair: dict[str, Any], head: str) -> None:
    """From the reference target's hidden state and shared K/V (20 rows: past the sliding window,
    whose last W + 1 rows the assistant reads), k = 1..4 greedy drafts: the same tokens, and
    logits within TOL."""
    target, drafter = pair["target"], pair["drafters"][head]
    ids = prompt(20)
    out = target_outputs(target, ids)
    kv = {kind: KVRows(k, v) for kind, (k, v) in out.shared_kv_states.items()}
    x = out.logits[0, -1].argmax().view(1)
    hidden = out.hidden_states[-1][:, -1]  # after the final norm
    for k in range(1, 5):
        ref_tokens, ref_logits = reference_drafts(target, pair["refs"][head], ids, k, out)
        d = drafter.draft(x, hidden, torch.tensor([len(ids)]), kv, k)
        assert d.tokens[0].tolist() == ref_tokens
        assert d.logits.shape == (1, k, 256) and d.logits.dtype == torch.float32
        assert_close(d.logits[0], ref_logits)
    assert len(set(ref_tokens)) > 1, "a draft that repeats one token checks little"


def engine_streams(
    model: Any, runs: list[tuple[list[int], int, int]], kv_dtype: str = "auto"
) -> tuple[ModelRunner, list[dict[str, Any]]]:
    """The target in one ModelRunner (pages of 4 rows; slot 0 and two pages held by another
    stream), a stream a run (ids, cut, steps) in slots 1, 2, ..: ids in two passes cut at `cut`,
    then `steps` greedy decode rows. Each stream's fed tokens, next token, last hidden state,
    (slot, pages, position) and its shared K/V gathered from the pages and rings."""
    runner = ModelRunner(
        model, num_pages=40, num_slots=len(runs) + 1, page_rows=4, kv_dtype=kv_dtype
    )
    open_stream(runner, 0, 8).lease.cover(8)
    out = []
    for slot, (ids, cut, steps) in enumerate(runs, start=1):
        stream = open_stream(runner, slot, 40)
        fed = list(ids)
        runner.run([stream.rows(ids[:cut])])
        (logits,) = runner.run([stream.rows(ids[cut:])])
        for _ in range(steps):
            fed.append(int(logits[-1].argmax()))
            (logits,) = runner.run([stream.rows(fed[-1:])])
        assert model.last_hidden is not None
        where = (slot, stream.lease.cover(stream.pos), stream.pos)
        x = int(logits[-1].argmax())
        out.append({"fed": fed, "x": x, "hidden": model.last_hidden, "where": where})
    for got in out:
        got["kv"] = gather_shared_kv(model, runner.rows, runner.slots, [got["where"]])
    return runner, out


def engine_stream(
    pair: dict[str, Any], ids: list[int], cut: int, steps: int, kv_dtype: str = "auto"
) -> dict[str, Any]:
    return engine_streams(pair["ours"], [(ids, cut, steps)], kv_dtype)[1][0]


def assert_batch_drafts_alone(model: Any, drafter: Any) -> None:
    """Two streams (23 and 7 rows) gathered and drafted in one batch draft the bits each drafts
    alone."""
    runner, streams = engine_streams(model, [(prompt(20), 9, 3), (prompt(6, 6), 4, 1)])
    dev = model.device
    kv = gather_shared_kv(model, runner.rows, runner.slots, [s["where"] for s in streams])
    assert kv[F].lengths == [23, 7] and kv[S].lengths == [WINDOW - 1] * 2
    both = drafter.draft(
        torch.tensor([s["x"] for s in streams], device=dev),
        torch.cat([s["hidden"] for s in streams]),
        torch.tensor([s["where"][2] for s in streams], device=dev),
        kv,
        3,
    )
    for b, s in enumerate(streams):
        alone = drafter.draft(
            torch.tensor([s["x"]], device=dev),
            s["hidden"],
            torch.tensor([s["where"][2]], device=dev),
            s["kv"],
            3,
        )
        assert torch.equal(both.tokens[b], alone.tokens[0])
        assert torch.equal(both.logits[b], alone.logits[0])


def test_streams_draft_alone_in_a_batch(pair: dict[str, Any]) -> None:
    assert_batch_drafts_alone(pair["ours"], pair["drafters"]["centroids"])


@pytest.mark.parametrize("cut, steps", [(13, 0), (9, 3)])
def test_gathered_kv_is_the_references_shared_kv(
    pair: dict[str, Any], cut: int, steps: int
) -> None:
    """After 20 prompt rows (and 3 decode rows: the ring wrapped), the gathered full rows are
    all of transformers' shared K/V rows, the sliding ones its last W - 1 (what a ring keeps);
    the last hidden state is its hidden_states[-1]."""
    got = engine_stream(pair, prompt(20), cut, steps)
    out = target_outputs(pair["target"], got["fed"])
    assert store_layers(pair["ours"].cfg) == {S: 0, F: 1}
    p = len(got["fed"])
    for kind, keep in ((F, p), (S, WINDOW - 1)):
        ref_k, ref_v = out.shared_kv_states[kind]
        rows = got["kv"][kind]
        assert rows.lengths == [keep]
        torch.testing.assert_close(rows.keys, ref_k[:, :, p - keep :], rtol=0, atol=1e-5)
        torch.testing.assert_close(rows.values, ref_v[:, :, p - keep :], rtol=0, atol=1e-5)
    torch.testing.assert_close(got["hidden"], out.hidden_states[-1][:, -1], rtol=0, atol=1e-5)


def test_fp8_rows_and_rings_come_back_dequantized(pair: dict[str, Any]) -> None:
    """Under TF_KV_DTYPE=fp8 the gathered rows are the stored e4m3 values times their scales:
    the reference's within e4m3's rounding (3 mantissa bits: about 1/16 of a value; a tenth of
    the largest here), in the model dtype."""
    got = engine_stream(pair, prompt(20), 9, 3, kv_dtype="fp8")
    out = target_outputs(pair["target"], got["fed"])
    p = len(got["fed"])
    for kind, keep in ((F, p), (S, WINDOW - 1)):
        for ours, ref in zip(
            (got["kv"][kind].keys, got["kv"][kind].values), out.shared_kv_states[kind]
        ):
            ref = ref[:, :, p - keep :]
            assert ours.dtype == torch.float32 and ours.shape == ref.shape
            assert (ours - ref).abs().max() <= 0.1 * ref.abs().max()


def test_the_drafter_reads_the_hidden_rows_of_its_runners_last_pass(pair: dict[str, Any]) -> None:
    """The drafter reads the pass its runner ran last (Gemma4Model.pass_hidden(runner.
    last_pass); a GraphRunner's is the static pass it replayed, its graph's own output), not
    the model's last forward (under CUDA graphs the last captured graph's): here a verify run's
    accepted row after another runner ran a pass on the same model."""
    from tensorfold.engine.cuda_graphs import GraphRunner
    from tensorfold.family.drafter import DraftAsk
    from tensorfold.family.forward_pass import StreamRows
    from tensorfold_gemma4.assistant_drafter import AssistantDrafter

    model, assistant = pair["ours"], pair["drafters"]["tied"]
    ids = prompt(12)
    runner = GraphRunner(model, num_pages=4, num_slots=1, page_rows=8)
    stream = open_stream(runner, 0, 16)
    runner.run([stream.rows(ids[:9])])
    pages = list(stream.lease.cover(12))
    (logits,) = runner.run([StreamRows(0, 9, ids[9:12], pages, "all", (10, 11), rewind=True)])
    assert runner.last_pass is not None
    want = model.pass_hidden(runner.last_pass)
    assert want is not None and want.shape[0] == 3
    want = want[1:2].clone()  # row 1 (position 10): one draft accepted
    runner.rewind_slot(0, (0, 11))
    other = ModelRunner(model, num_pages=1, num_slots=1, page_rows=8)
    other.run([StreamRows(0, 0, prompt(5, 9), [0], "last")])
    assert model.last_hidden is not None and not torch.equal(model.last_hidden, want)
    x = int(logits[1].argmax())
    with mock.patch.object(assistant, "draft", wraps=assistant.draft) as draft:
        got = AssistantDrafter(assistant, model, runner).propose([DraftAsk(0, pages, 11, x, 1)], 2)
    hidden = draft.call_args.args[1]
    assert torch.equal(hidden, want)
    kv = gather_shared_kv(model, runner.rows, runner.slots, [(0, pages, 11)])
    alone = assistant.draft(torch.tensor([x]), want, torch.tensor([11]), kv, 2)
    assert got == alone.tokens.tolist()


@pytest.mark.parametrize("head", HEADS)
def test_engine_to_drafts_matches_transformers(pair: dict[str, Any], head: str) -> None:
    """The whole path: target in our engine, K/V gathered, 4 drafts == transformers' generator
    on its own target, while the context fits the ring (6 prompt rows + 1 decode row <= W - 1).
    Past it, our drafts are transformers' assistant reading the last W - 1 sliding rows."""
    drafter, ref = pair["drafters"][head], pair["refs"][head]
    short = engine_stream(pair, prompt(6), 4, 1)
    ref_tokens, ref_logits = reference_drafts(pair["target"], ref, short["fed"], 4)
    d = drafter.draft(
        torch.tensor([short["x"]]), short["hidden"], torch.tensor([7]), short["kv"], 4
    )
    assert d.tokens[0].tolist() == ref_tokens
    assert_close(d.logits[0], ref_logits)

    long = engine_stream(pair, prompt(20), 9, 3)
    out = target_outputs(pair["target"], long["fed"])
    k, v = out.shared_kv_states[S]
    out.shared_kv_states[S] = (k[:, :, 1 - WINDOW :], v[:, :, 1 - WINDOW :])
    ref_tokens, ref_logits = reference_drafts(pair["target"], ref, long["fed"], 4, out)
    d = drafter.draft(torch.tensor([long["x"]]), long["hidden"], torch.tensor([23]), long["kv"], 4)
    assert d.tokens[0].tolist() == ref_tokens
    assert_close(d.logits[0], ref_logits)


def test_store_layers_without_kv_sharing() -> None:
    """transformers' store layers with KV sharing; without, the last layer of each kind."""
    from tensorfold_gemma4.config import Gemma4Config

    kinds = [S, F, S, S, F, S]
    base = {k: v for k, v in TARGET.items() if k != "num_kv_shared_layers"}
    plain = {**base, "num_hidden_layers": 6, "layer_types": kinds}
    assert store_layers(Gemma4Config.from_dict(plain)) == {S: 3, F: 5}  # the last is forced F
    shared = {**plain, "num_kv_shared_layers": 2}
    assert store_layers(Gemma4Config.from_dict(shared)) == {S: 3, F: 1}


def test_assistant_config_refusals(pair: dict[str, Any]) -> None:
    raw = Checkpoint.open(pair["root"] / "centroids").config
    cfg = AssistantConfig.from_dict(raw)
    assert cfg.use_ordered_embeddings and cfg.tokens_per_centroid == 16
    assert all(layer.reuses_kv for layer in cfg.text.layers)
    for bad, match in (
        ({"model_type": "gemma4"}, "model_type"),
        ({"num_centroids": 15}, "centroid"),
        ({"text_config": {**raw["text_config"], "enable_moe_block": True}}, "enable_moe_block"),
        ({"text_config": {**raw["text_config"], "num_kv_shared_layers": 1}}, "num_kv_shared"),
    ):
        with pytest.raises(ConfigError, match=match):
            AssistantConfig.from_dict({**raw, **bad})


def test_a_mismatched_target_is_refused(pair: dict[str, Any], tmp_path: Path) -> None:
    import json
    import shutil

    from tensorfold.family.checkpoint import CheckpointError

    folder = tmp_path / "wide"
    shutil.copytree(pair["root"] / "tied", folder)
    config = json.loads((folder / "config.json").read_text())
    config["backbone_hidden_size"] = 128
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="backbone_hidden_size=128"):
        load_assistant(Checkpoint.open(folder), pair["ours"])


@pytest.mark.gpu
def test_the_gpu_path(pair: dict[str, Any]) -> None:
    """On CUDA (the Triton linear, norms, RoPE and GeGLU): in fp32 the target in a GPU
    ModelRunner, its gathered K/V and both heads' 4 drafts give transformers' (CPU) tokens,
    logits within TOL; in bf16 two streams drafted in one batch give the bits each gives alone."""
    for dtype in ("float32", "bfloat16"):
        target = load(Checkpoint.open(pair["root"] / "target"), "cuda", dtype)
        for head in HEADS:
            drafter = load_assistant(Checkpoint.open(pair["root"] / head), target)
            if dtype == "bfloat16":
                assert_batch_drafts_alone(target, drafter)
                continue
            (short,) = engine_streams(target, [(prompt(6), 4, 1)])[1]
            ref_tokens, ref_logits = reference_drafts(
                pair["target"], pair["refs"][head], short["fed"], 4
            )
            at = torch.tensor([7], device="cuda")
            d = drafter.draft(
                torch.tensor([short["x"]], device="cuda"), short["hidden"], at, short["kv"], 4
            )
            assert d.tokens[0].tolist() == ref_tokens
            assert_close(d.logits[0].cpu(), ref_logits)


# --- as the lanes' draft model (`--draft model`, the model_drafter hook) ----------------------
# The demo drafted by an assistant checkpoint at its widths (random weights): drafted == plain
# through the lanes' rounds, greedy and seeded, 4 streams and alone, a prompt past the sliding
# window; starts that cannot draft with a model are refused naming why.

DRAFT_PROMPTS = (
    "Once upon a time there was a",
    "What is the capital of Japan?",
    "a b c d a b c d a b",
    " ".join(["the river and the stone, the light and the garden"] * 24),  # past the window
)


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def demo_assistant(demo_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An assistant for the demo: its backbone width and vocabulary, head dims of the demo's
    store layers (sliding 32, full 64 with one KV head), two sliding layers and a full one."""
    pytest.importorskip("transformers", reason="transformers 5.23.0 builds the checkpoint")
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    top = json.loads((demo_folder / "config.json").read_text())
    text = top.get("text_config", top)
    config = Gemma4AssistantConfig(
        text_config=dict(
            vocab_size=text["vocab_size"],
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            num_attention_heads=2,
            num_key_value_heads=text["num_key_value_heads"],
            head_dim=text["head_dim"],
            global_head_dim=64,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            sliding_window=text["sliding_window"],
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=0,
            enable_moe_block=False,
            max_position_embeddings=4096,
            initializer_range=0.1,
        ),
        backbone_hidden_size=text["hidden_size"],
    )
    torch.manual_seed(3)
    with all_reuse_layers():
        model = perturb(Gemma4AssistantForCausalLM(config), 4)
    folder = tmp_path_factory.mktemp("assistant")
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def drafted_llm(demo_folder: Path, demo_assistant: Path) -> Any:
    flags: dict[str, Any] = dict(
        context=1024, parallel=4, kv_poison=True, draft="model", draft_model=demo_assistant
    )
    llm = testing.open_llm("gemma4", demo_folder, **flags)
    yield llm
    testing.close_even(llm)


@pytest.mark.parametrize("name", conformance.SAMPLINGS)
def test_assistant_drafts_equal_plain_together_and_alone(drafted_llm: Any, name: str) -> None:
    params = conformance.DraftGates().sampling(name, max_tokens=16)
    testing.assert_drafted_equals_plain(drafted_llm, DRAFT_PROMPTS, params, source="model")
    testing.assert_drafted_equals_plain(drafted_llm, DRAFT_PROMPTS[-1:], params, source="model")


def test_a_start_that_cannot_draft_with_a_model_is_refused(
    demo_folder: Path, demo_assistant: Path
) -> None:
    with pytest.raises(SettingsError, match="--draft-model DIR"):
        testing.open_llm("gemma4", demo_folder, draft="model")
    with pytest.raises(SettingsError, match="use --draft model"):
        testing.open_llm("gemma4", demo_folder, draft="ngram", draft_model=demo_assistant)
    with pytest.raises(SettingsError, match="lfm2_moe family has no draft model"):
        testing.open_llm("lfm2_moe", None, draft="model", draft_model=demo_assistant)


def test_the_assistant_drafts_every_round_with_the_policy_off(drafted_llm: Any) -> None:
    """The assistant proposes every round (the policy off): its drafts are verified, whatever
    they are worth."""
    lanes = drafted_llm.served.engine.lanes
    before = lanes.tokens_drafted
    with testing.drafting(drafted_llm, "model", 4):
        drafted_llm.generate(
            DRAFT_PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        )
    assert lanes.tokens_drafted - before >= 2 * 4
