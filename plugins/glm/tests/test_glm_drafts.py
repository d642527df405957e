"""drafted == plain on the demo checkpoint (the conformance suite's DraftGates): verify runs
stay recurrent in the KDA layers, their taps rewind the KDA and conv states. With `--draft mtp`
the demo's own MTP layer drafts (its rows run in every pass, tapped and rewound with the rest),
and a start that cannot draft with one is refused naming why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Sequence

import pytest

from tensorfold import conformance, testing
from tensorfold.config.settings import SettingsError
from tensorfold.engine.runner import ModelRunner, open_stream
from tensorfold.engine.sampling import SamplingParams
from tensorfold.family.drafter import DraftAsk
from tensorfold.family.forward_pass import StreamRows
from tensorfold_glm.demo import build_demo
from tensorfold_glm.mtp import draft, target_pass


class TestDrafts(conformance.DraftGates):
    family, build_demo = "glm5_next", build_demo
    chat_turn_words = (80, 50)  # the store keeps states on the 64-row KDA grid: turns past it


class TestMtpDrafts(conformance.DraftGates):
    family, build_demo = "glm5_next", build_demo
    chat_turn_words = (80, 50)
    source, draft_flags = "mtp", {"draft": "mtp"}


def test_a_start_that_cannot_draft_with_an_mtp_layer_is_refused(tmp_path: Path) -> None:
    """Families without one, a glm checkpoint whose config declares none or whose weights hold
    none, a draft folder beside it: each refused before any weight loads, naming the problem
    and what is accepted instead."""
    accepted = "use --draft ngram, or --draft model --draft-model DIR"
    for family in ("lfm2_moe", "gemma4"):
        with pytest.raises(SettingsError, match=f"{family} family has no MTP layer.*{accepted}"):
            testing.open_llm(family, None, draft="mtp")
    demo = build_demo(tmp_path / "demo")
    undeclared = shutil.copytree(demo, tmp_path / "undeclared")
    cfg = json.loads((undeclared / "config.json").read_text())
    del cfg["text_config"]["num_nextn_predict_layers"]
    (undeclared / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SettingsError, match=f"declares no MTP layer.*{accepted}"):
        testing.open_llm("glm5_next", undeclared, draft="mtp")
    trunk_only = tmp_path / "trunk_only"
    trunk_only.mkdir()
    for f in demo.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, trunk_only / f.name)
    from safetensors.torch import load_file, save_file

    mtp = f"model.language_model.layers.{cfg['text_config']['num_hidden_layers']}."
    for f in demo.glob("*.safetensors"):
        kept = {k: v for k, v in load_file(str(f)).items() if not k.startswith(mtp)}
        save_file(kept, str(trunk_only / f.name))
    with pytest.raises(SettingsError, match=f"its weights hold none.*{accepted}"):
        testing.open_llm("glm5_next", trunk_only, draft="mtp")
    with pytest.raises(SettingsError, match="use --draft model to draft with the folder"):
        testing.open_llm("glm5_next", demo, draft="mtp", draft_model=trunk_only)
    llm = testing.open_llm("glm5_next", trunk_only)  # served without drafts, as before
    testing.close_even(llm)


class CheckedDrafter:
    """The served MTP drafter, each of its proposals compared with the MTP's drafts computed
    afresh on a runner of its own: the stream's whole history through the target in one pass,
    then mtp.draft's catch-up over it and the next token. Equal (rows are the same bits
    whatever pass computes them) only while the served MTP's rows, state and carry are where
    the stream is: after prompt chunks, verify rounds and their rewinds, resumed prompts and
    forks."""

    def __init__(self, served: Any, lanes: Any) -> None:
        self.served, self.lanes, self.model = served, lanes, served.model
        self.runner = ModelRunner(self.model, num_pages=4, num_slots=1, page_rows=512)
        self.checked, self.differ = 0, []

    def propose(self, asks: Sequence[DraftAsk], k: int) -> list[list[int]]:
        got = self.served.propose(asks, k)
        live = {s.slot: s for s in self.lanes.live}
        for ask, drafts in zip(asks, got):
            s = live[ask.slot]
            assert s.generated[-1] == ask.token and s.pos == ask.pos
            want = self.afresh((s.req.prompt + s.generated)[: ask.pos], ask.token, len(drafts))
            if drafts != want:
                self.differ.append((ask.pos, drafts, want))
            self.checked += 1
        return got

    def afresh(self, fed: list[int], token: int, k: int) -> list[int]:
        runner = self.runner
        stream = open_stream(runner, 0, len(fed) + k + 1)
        try:
            _, hidden = target_pass(self.model, runner.rows, runner.slots, [stream.rows(fed)])
            run = StreamRows(0, 0, [*fed, token], stream.lease.cover(len(fed) + k + 1))
            return draft(self.model, runner.rows, runner.slots, [run], hidden, k)[0].tolist()
        finally:
            stream.lease.release()


def test_served_mtp_drafts_equal_drafts_computed_afresh(tmp_path: Path) -> None:
    """Chats of two turns (the second resumed from the prompt store) and n = 3 seeded choices,
    drafted by the MTP at k = 4 with rejections on the way: every round's drafts are those the
    MTP gives over the stream's history computed afresh."""
    flags = dict(kv_poison=True, kv_share=16, prompt_cache_gib=0.05, draft="mtp")
    llm = testing.open_llm("glm5_next", build_demo(tmp_path), context=1024, parallel=3, **flags)
    try:
        lanes = llm.served.engine.lanes
        checked = lanes.model_drafter = CheckedDrafter(lanes.model_drafter, lanes)
        users = [testing.chat_turns(c, 2, 80, 50) for c in range(2)]
        histories: list[list[dict]] = [[] for _ in users]
        params = SamplingParams(temperature=0, max_tokens=12)
        with testing.drafting(llm, "mtp", 4):
            for t in range(2):
                for c, turns in enumerate(users):
                    histories[c].append({"role": "user", "content": turns[t]})
                done = llm.chat(histories, params)
                assert t == 0 or all(d.cached_tokens > 0 for d in done)
                for c, d in enumerate(done):
                    histories[c].append({"role": "assistant", "content": d.text})
            seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True)
            llm.generate(["Once upon a time there was a"], seeded, n=3)
        assert checked.checked >= 20 and checked.differ == []
        assert 0 < lanes.drafts_accepted < lanes.tokens_drafted  # kept some, rewound some
    finally:
        testing.close_even(llm)


GPU_FLAGS = dict(device="cuda", dtype="bfloat16", memory_limit_gib=4, context=1024)


@pytest.mark.gpu
def test_gpu_mtp_drafts_equal_plain(tmp_path: Path) -> None:
    """On the GPU in bf16 (Triton kernels, decode rounds replayed from CUDA graphs, the MTP's
    rows captured with the trunk's): the demo served with --draft mtp gives, drafted at k = 4
    with every round drafting, the tokens and logprobs of a server without it, 8 streams
    together and one alone, greedy and seeded; and its first drafts are kept far above chance
    on the demo's own questions and stories (the MTP's rows are current under the graphs)."""
    from tensorfold.family.chat_template import render_chat
    from tensorfold.family.demo_text import QA, paragraphs
    from tensorfold_glm import demo as glm_demo

    folder = build_demo(tmp_path)
    gates = conformance.DraftGates()
    prompts = list(gates.prompts_text)
    plain_llm = testing.open_llm("glm5_next", folder, parallel=8, **GPU_FLAGS)
    try:
        plain = {n: plain_llm.generate(prompts, gates.sampling(n)) for n in conformance.SAMPLINGS}
    finally:
        testing.close_even(plain_llm)
    llm = testing.open_llm(
        "glm5_next", folder, parallel=8, kv_poison=True, draft="mtp", **GPU_FLAGS
    )
    try:
        for name in conformance.SAMPLINGS:
            params = gates.sampling(name)
            testing.assert_drafted_equals_plain(
                llm, prompts, params, source="mtp", plain=plain[name]
            )
            testing.assert_drafted_equals_plain(
                llm, prompts[:1], params, source="mtp", plain=plain[name][:1]
            )
        tok = llm.served.tokenizer
        own = [
            tok.encode(
                render_chat(
                    tok.chat_template or "", [{"role": "user", "content": q}], enable_thinking=False
                ).text
            )
            for q, _ in QA[:3]
        ] + [
            tok.encode(glm_demo.GMASK + glm_demo.SOP + " ".join(p.split()[:4]))
            for p in paragraphs()[:2]
        ]
        lanes = llm.served.engine.lanes
        drafted, kept = lanes.tokens_drafted, lanes.drafts_accepted
        with testing.drafting(llm, "mtp", 1):
            llm.generate(own, SamplingParams(temperature=0, max_tokens=25, ignore_eos=True))
        rate = (lanes.drafts_accepted - kept) / (lanes.tokens_drafted - drafted)
        print(f"MTP first drafts kept on the GPU (bf16, served): {rate:.3f}")
        assert rate >= 0.5
    finally:
        testing.close_even(llm)


def kda_mtp_checkpoint(tmp_path: Path) -> Path:
    """The demo's tokenizer and shape with a KDA + dense MTP layer (the lists' extra entry),
    random weights: an MTP layer with fixed state of its own."""
    from safetensors.torch import save_file

    from tensorfold_glm.demo_weights import build_weights

    folder = shutil.copytree(build_demo(tmp_path / "demo"), tmp_path / "kda_mtp")
    cfg = json.loads((folder / "config.json").read_text())
    t = cfg["text_config"]
    t["layer_types"] = [*t["layer_types"], "linear_attention"]
    t["mlp_layer_types"] = [*t["mlp_layer_types"], "dense"]
    (folder / "config.json").write_text(json.dumps(cfg))
    for f in folder.glob("*.safetensors"):
        f.unlink()
    save_file(build_weights(cfg), str(folder / "model.safetensors"))
    return folder


def test_a_kda_mtp_layer_drafts_from_its_own_state(tmp_path: Path) -> None:
    """A KDA MTP layer served: its recurrent state and conv tail are tapped and rewound with
    the trunk's, and the drafter puts them back after its steps; every round's drafts equal
    those computed afresh, drafted == plain, through verify rounds (random weights: nearly every
    draft refused) and n = 2 forks."""
    folder = kda_mtp_checkpoint(tmp_path)
    prompts = ["Once upon a time there was a", "What is the capital of Japan?"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain_llm = testing.open_llm("glm5_next", folder, parallel=2)
    try:
        plain = plain_llm.generate(prompts, params)
    finally:
        testing.close_even(plain_llm)
    llm = testing.open_llm("glm5_next", folder, parallel=3, kv_poison=True, draft="mtp")
    try:
        lanes = llm.served.engine.lanes
        assert "L6.kda" in lanes.runner.slots.buffers
        checked = lanes.model_drafter = CheckedDrafter(lanes.model_drafter, lanes)
        testing.assert_drafted_equals_plain(llm, prompts, params, source="mtp", plain=plain)
        seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True)
        with testing.drafting(llm, "mtp", 4):
            llm.generate(prompts[:1], seeded, n=2)
        assert checked.checked >= 10 and checked.differ == []
    finally:
        testing.close_even(llm)
