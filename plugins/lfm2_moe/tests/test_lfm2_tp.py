"""lfm2_moe under tensor and expert parallel at --tp 2 with gloo on the CPU (fp32).

- passes: each rank loads its shard of the tiny transformers checkpoints (KV heads split, and
  replicated when fewer than ranks; conv channels; experts across ranks; the vocabulary);
  logits match one rank's within the parity tolerance, greedy tokens are equal, and the
  pass-level gates hold at --tp 2 (concurrent == solo, resumed == fresh, pages == windows,
  poisoned == clean);
- the engine: LLM(tp=2) on the demo checkpoint, rank 0 here and a follower it starts: the gates
  through the lanes and the prompt store, and tokens equal to one rank's;
- `tensorfold serve --tp 2` answers a real request, says its plan is per rank, and stops with
  an error naming the follower when that follower is killed;
- under torchrun's variables, a rank short of memory is named in the refusal.

Ranks run as subprocesses of this file (`python test_lfm2_tp.py ...`) on a free port.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorfold import conformance, testing
from tensorfold.engine.runner import ModelRunner
from tensorfold.engine.sampling import SamplingParams
from tensorfold.family.checkpoint import Checkpoint
from tensorfold_lfm2_moe.demo import build_demo
from tensorfold_lfm2_moe.hooks import HOOKS
from tensorfold_lfm2_moe.model import load

GREEDY_STEPS = 8
WORKER_TIMEOUT_S = 120
LAUNCH = "import sys; from tensorfold.cli.commands import main; sys.exit(main())"


# -- passes on the tiny checkpoints, one subprocess a rank ------------------------------------


def passes_worker(rank: int, port: int, prompt_file: str, out: str, *paths: str) -> None:
    """One rank, for each checkpoint: its shard, the logits and greedy tokens, and the
    pass-level gates at --tp 2."""
    import torch.distributed as dist

    testing.join_gloo(rank, port)
    prompt = torch.load(prompt_file)
    got = {}
    for path in paths:
        model = testing.open_shard(path, rank, HOOKS, load)
        make_runner = testing.runner_factory(model)
        got[path] = testing.greedy(make_runner(), prompt, GREEDY_STEPS)
        # the gates at --tp 2: every rank runs the same checks, so their collectives meet
        prompts = [prompt[:300], prompt[:250], prompt[100:400]]
        testing.assert_streams_together_equal_alone(
            make_runner, model, prompts, (0, 1, 2), num_pages=6, max_rows=512
        )
        one = testing.run_on_pages(model, prompt, [0, 1], 512, [0, len(prompt)])
        resumed = testing.run_on_pages(model, prompt, [0, 1], 512, [0, 200, 513, len(prompt)])
        assert torch.equal(one, resumed)  # resumed == fresh: cut anywhere, the same bits
        testing.assert_shuffled_pages_change_nothing(model, prompt, [0, 300, len(prompt)])
        testing.assert_poisoned_pages_change_nothing(make_runner, prompt)
    if rank == 0:
        torch.save(got, out)
    dist.destroy_process_group()


def test_shards_give_one_ranks_logits_and_tokens_and_keep_the_gates(tiny_paths, tmp_path):
    """Both tiny shapes: lfm2_tiny (2 KV heads, one a rank) and attn_first (1 KV head,
    replicated; conv biases; 6 experts, top-3)."""
    gen = torch.Generator().manual_seed(1234)  # the tiny fixture's prompt
    prompt = torch.randint(3, 256, (600,), generator=gen).tolist()
    prompt_file, out = tmp_path / "prompt.pt", tmp_path / "out.pt"
    torch.save(prompt, prompt_file)
    paths = [str(p) for p in tiny_paths.values()]
    testing.run_ranks(__file__, str(prompt_file), str(out), *paths, timeout_s=WORKER_TIMEOUT_S)
    got = torch.load(out)
    for path in paths:
        model = load(Checkpoint.open(path), "cpu", "float32")
        logits, tokens = testing.greedy(
            ModelRunner(model, num_pages=8, num_slots=4), prompt, GREEDY_STEPS
        )
        torch.testing.assert_close(got[path][0], logits, rtol=0, atol=1e-4)
        assert got[path][1] == tokens, path


# -- the engine: LLM(tp=2) here as rank 0, with the follower it starts ------------------------


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo(tmp_path_factory.mktemp("demo"))


class TestEngineGatesAtTp(conformance.EngineGatesAtTp):
    family, build_demo = "lfm2_moe", build_demo
    ids, lengths, max_tokens = (5, 700), (9, 130, 600), 8


# -- tensorfold serve --tp 2 ---------------------------------------------------------------


def start_serve_tp_2(demo: Path, log: Any, *flags: str) -> tuple[subprocess.Popen, str]:
    return testing.start_serve_tp_2(demo, log, *flags)


def test_serve_tp_2_answers_then_stops_when_a_follower_dies(demo: Path, tmp_path: Path):
    import openai

    log = open(tmp_path / "serve.log", "w")
    proc, url = start_serve_tp_2(demo, log)
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8,
            temperature=0,
        )
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
        log.flush()
        started = (tmp_path / "serve.log").read_text()
        found = re.search(r"started follower rank 1 \(pid (\d+)\)", started)
        assert found
        follower = int(found.group(1))
        os.kill(follower, signal.SIGKILL)  # the follower this server started
        assert proc.wait(timeout=30) == 1
        errors = (tmp_path / "serve.log").read_text()
        assert f"follower rank 1 (pid {follower}) exited with status -9" in errors
        assert "the server stopped" in errors
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_tp_2_stops_on_a_signal_with_its_follower(demo: Path, tmp_path: Path, sig):
    """A signal drains `--tp 2` within --shutdown-timeout: the open stream ends with "abort" and
    [DONE], rank 0 and its follower exit, and the shutdown census is said."""
    log = open(tmp_path / "serve.log", "w")
    proc, url = start_serve_tp_2(demo, log, "--shutdown-timeout", "1")
    try:
        testing.assert_signal_drains_tp_2(proc, url, tmp_path / "serve.log", sig)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


# -- torchrun's variables: a refusal names the rank that is short -------------------------------


def test_under_torchrun_a_refusal_names_the_short_rank(demo: Path, tmp_path: Path):
    port = str(testing.free_port())
    procs = []
    for rank, gib in ((0, "0.25"), (1, "0.001")):
        env = testing.clean_env(
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            TF_MEMORY_LIMIT_GIB=gib,
            TF_DEVICE="cpu",
            TF_TP_TIMEOUT_S="30",
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    LAUNCH,
                    "generate",
                    "--family",
                    "lfm2_moe",
                    "--model",
                    str(demo),
                    "--context",
                    "4096",
                    "--parallel",
                    "4",
                    "hello",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    outs = [p.communicate(timeout=WORKER_TIMEOUT_S) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    assert "tensorfold: error: rank 1 of --tp 2 is short: --parallel 4 needs" in outs[0][1]
    assert "tensorfold: error" not in outs[1][1]  # rank 0 says it


if __name__ == "__main__":  # a rank of the tests above: python test_lfm2_tp.py RANK PORT ...
    rank_, port_, *rest = sys.argv[1:]
    passes_worker(int(rank_), int(port_), *rest)


def test_a_warmed_up_tp_2_engine_answers_as_a_cold_one(demo: Path):
    """The warm-up at start (on for CUDA) drives the follower rank through its passes too, and
    leaves both ranks as a cold start would: the same tokens, the pool even."""
    params = SamplingParams(temperature=0, max_tokens=8)
    replies = {}
    for warm in (False, True):
        llm = testing.open_llm("lfm2_moe", demo, tp=2, warm_up=warm, parallel=2, context=4096)
        try:
            replies[warm] = [
                c.token_ids for c in llm.generate(["Once upon a time", "Hello"], params)
            ]
        finally:
            testing.close_even(llm)
    assert replies[True] == replies[False]
