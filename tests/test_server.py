"""`tensorfold serve` as a real process on a free port, driven by the official openai client.

`ServedDemo` (also used by the other server test modules) starts the demo checkpoint with a
small memory budget, reads the address the server prints, and reads its /metrics.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

START_TIMEOUT_S = 90
LAUNCH = "import sys; from tensorfold.cli.commands import main; sys.exit(main())"
FAMILY = "lfm2_moe"


class ServedDemo:
    """A `tensorfold serve` subprocess serving the demo checkpoint."""

    def __init__(
        self, tmp: Path, *flags: str, api_key: str | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.tmp = tmp
        self.api_key = api_key
        environ = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}
        environ.update(TF_DEMO_CACHE=str(tmp / "demo"), TF_MEMORY_LIMIT_GIB="1", **(env or {}))
        args = ["serve", "--family", FAMILY, "--port", "0", "--context", "4096", *flags]
        if api_key:
            args += ["--api-key", api_key]
        self.log = open(tmp / "serve.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, *args],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=environ,
        )
        self.printed: list[str] = []
        self.url = self._read_address()
        self.base = self.url.removesuffix("/v1")
        self._wait_healthy()

    def _read_address(self) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.printed.append(line.rstrip("\n"))
            if line.startswith("serving "):
                return line.split(" at ")[-1].strip()
        self.proc.kill()
        raise AssertionError(f"the server did not start: {self.printed} {self.logs()[-2000:]}")

    def _wait_healthy(self) -> None:
        for _ in range(100):
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.05)
        raise AssertionError("/health never answered 200")

    def logs(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.tmp / "serve.log").read_text()

    def client(self, **kw: object) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url, api_key=self.api_key or "none", max_retries=0, timeout=60, **kw
        )  # type: ignore[arg-type]

    def metrics(self) -> dict[str, float]:
        """Samples by name and labels, e.g. 'tensorfold_pool_pages{state=free}'."""
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def wait_even(self, timeout: float = 15.0) -> dict[str, float]:
        """Wait until idle and the census adds up, as /metrics shows it; fail otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            page = {
                k.split("=")[1].rstrip("}"): v
                for k, v in m.items()
                if k.startswith("tensorfold_pool_pages{")
            }
            even = (
                page["promised"] == 0
                and page["live"] == 0
                and page["free"] + page["store"] == page["total"]
                and m["tensorfold_lanes{state=busy}"] == 0
                and m["tensorfold_requests_waiting"] == 0
            )
            if even:
                assert m["tensorfold_uneven_total"] == 0, self.logs()[-3000:]
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"the census is not even: {page}")
            time.sleep(0.05)

    def stop(self, timeout: float = 60) -> tuple[int, str]:
        """SIGTERM; returns the exit status and what it printed after the address."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        self.log.close()
        return self.proc.returncode, out or ""

    def stop_idle(self) -> None:
        """stop, and check it exited 0 with its KV pool idle (nothing promised)."""
        rc, out = self.stop()
        assert rc == 0 and "kv pool idle: promised 0" in out, self.logs()[-3000:]


def served(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    *flags: str,
    api_key: str | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[ServedDemo]:
    """A module fixture's server: a ServedDemo in a fresh folder `name`, handed to the tests,
    then stopped idle."""
    s = ServedDemo(tmp_path_factory.mktemp(name), *flags, api_key=api_key, env=env)
    yield s
    s.stop_idle()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedDemo]:
    s = ServedDemo(tmp_path_factory.mktemp("serve"), "--parallel", "4")
    yield s
    s.stop()


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_list(server: ServedDemo) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["lfm2_moe-demo"]
    assert server.client().models.retrieve("lfm2_moe-demo").id == "lfm2_moe-demo"


def test_chat_completion_and_usage(server: ServedDemo) -> None:
    r = server.client().chat.completions.create(
        model="lfm2_moe-demo", messages=MESSAGES, max_tokens=12, temperature=0
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u is not None and u.prompt_tokens > 5 and 1 <= u.completion_tokens <= 12
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details is not None and u.prompt_tokens_details.cached_tokens == 0
    assert isinstance(r.model_extra and r.model_extra["seed"], int)


def test_chat_stream_equals_whole(server: ServedDemo) -> None:
    c = server.client()
    kw = dict(model="lfm2_moe-demo", messages=MESSAGES, max_completion_tokens=16, temperature=0)
    whole = c.chat.completions.create(**kw)  # type: ignore[call-overload]
    chunks = list(
        c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )  # type: ignore[call-overload]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finals[-1] == whole.choices[0].finish_reason and not any(finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(ch.usage is None for ch in chunks[:-1])


def test_completions_text_ids_and_stream(server: ServedDemo) -> None:
    from tensorfold.family.checkpoint import Checkpoint
    from tensorfold.family.tokenizer import Tokenizer

    c = server.client()
    prompt = "The little engine woke before dawn and"
    text = c.completions.create(model="lfm2_moe-demo", prompt=prompt, max_tokens=10, temperature=0)
    from tensorfold_lfm2_moe.demo import DEMO_NAME

    tok = Tokenizer.from_checkpoint(Checkpoint.open(server.tmp / "demo" / DEMO_NAME))
    ids = tok.encode(prompt, add_special_tokens=True)
    by_ids = c.completions.create(model="lfm2_moe-demo", prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == text.choices[0].text
    assert text.usage is not None and text.usage.prompt_tokens == len(ids)
    stream = c.completions.create(
        model="lfm2_moe-demo", prompt=[prompt], max_tokens=10, temperature=0, stream=True
    )
    assert "".join(ch.choices[0].text for ch in stream) == text.choices[0].text


def test_default_max_tokens_of_completions_is_16(server: ServedDemo) -> None:
    r = server.client().completions.create(
        model="lfm2_moe-demo", prompt="One", temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage is not None and r.usage.completion_tokens == 16


def test_logprobs(server: ServedDemo) -> None:
    c = server.client()
    r = c.chat.completions.create(
        model="lfm2_moe-demo",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    assert r.choices[0].logprobs is not None and r.usage is not None
    content = r.choices[0].logprobs.content or []
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and entry.logprob <= tops[0] + 1e-6
        assert entry.top_logprobs[0].token == entry.token  # greedy takes the most likely
    cr = c.completions.create(
        model="lfm2_moe-demo", prompt="Numbers: one, two,", max_tokens=5, temperature=0, logprobs=2
    )
    lp = cr.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(t) <= 2 for t in lp.top_logprobs)


def test_seed_reproduces_sampling(server: ServedDemo) -> None:
    c = server.client()

    def run(seed: int | None) -> tuple[str, int]:
        # A question the demo was not taught: its answers spread over several it knows.
        unknown = [{"role": "user", "content": "Describe the moon."}]
        r = c.chat.completions.create(
            model="lfm2_moe-demo", messages=unknown, max_tokens=24, temperature=0.8, seed=seed
        )
        assert r.model_extra is not None
        return r.choices[0].message.content or "", r.model_extra["seed"]

    a, seed_a = run(1234)
    assert seed_a == 1234 and run(1234)[0] == a
    texts = {run(s)[0] for s in (1, 2, 3)}
    assert len(texts) > 1  # different seeds sample differently
    drawn, seed = run(None)
    assert run(seed)[0] == drawn  # the reported seed reproduces an unseeded request


def test_stop_string_and_extras(server: ServedDemo) -> None:
    c = server.client()
    base = (
        c.completions.create(
            model="lfm2_moe-demo", prompt="The little", max_tokens=12, temperature=0
        )
        .choices[0]
        .text
    )
    assert len(base) > 3
    stop = base[2:4]
    r = c.completions.create(
        model="lfm2_moe-demo",
        prompt="The little",
        max_tokens=12,
        temperature=0,
        stop=[stop],
        user="u1",
        extra_body={"some_future_field": {"x": 1}},
    )
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == base[: base.index(stop)]


def test_logit_bias_changes_tokens_and_stays_exact_among_others(server: ServedDemo) -> None:
    """A strong bias changes the sampled tokens; a biased request sent among others (the other
    lanes busy with unbiased ones) gets exactly the tokens it gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    c = server.client()
    kw = dict(
        model="lfm2_moe-demo", prompt="The little engine", max_tokens=12, temperature=0.9, seed=77
    )
    plain = c.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
    bias = {str(t): 8 for t in range(200, 260)} | {"264": -100}
    biased = dict(kw, logit_bias=bias)
    alone = c.completions.create(**biased).choices[0].text  # type: ignore[call-overload]
    assert alone != plain
    others = [dict(kw, seed=s, max_tokens=24) for s in range(3)]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(c.completions.create, **o) for o in others[:2]]
        mine = pool.submit(c.completions.create, **biased)
        futures.append(pool.submit(c.completions.create, **others[2]))
        assert mine.result().choices[0].text == alone
        assert all(f.result().choices[0].text for f in futures)


def test_metrics_and_census(server: ServedDemo) -> None:
    m = server.wait_even()
    assert m["tensorfold_prompt_tokens_total{source=computed}"] > 0
    assert m["tensorfold_time_to_first_token_seconds_count"] > 0
    assert m["tensorfold_time_between_tokens_seconds_count"] > 0
    assert m["tensorfold_device_memory_peak_bytes"] > 0
    assert m["tensorfold_lanes{state=free}"] == 4


def test_start_lines_once_and_no_idle_census_at_info(server: ServedDemo) -> None:
    """The plan and address are printed once on stdout, not logged again; the census after each
    drain is a debug line, so the (info) log has none after the requests above."""
    server.wait_even()
    assert [p for p in server.printed if p.startswith("kv plan")] != []
    assert len(server.printed) == 2, server.printed
    assert re.fullmatch(
        r"serving lfm2_moe-demo \(family lfm2_moe\): status page (http://\S+)/status, "
        r"API at \1/v1",
        server.printed[1],
    ), server.printed[1]
    logs = server.logs()
    assert "kv plan" not in logs and "serving" not in logs.replace("serving the demo", "")
    assert "kv pool idle" not in logs


def test_shutdown_lets_inflight_requests_end(server: ServedDemo) -> None:
    """Last in this module: SIGTERM mid-stream; the stream ends whole; exit 0 with the census."""
    stream = server.client().completions.create(
        model="lfm2_moe-demo",
        prompt="The little",
        max_tokens=200,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    it = iter(stream)
    next(it)
    server.proc.send_signal(signal.SIGTERM)
    rest = list(it)
    assert rest[-2].choices[0].finish_reason == "length"
    assert rest[-1].usage is not None and rest[-1].usage.completion_tokens == 200
    with pytest.raises(openai.APIError):  # refused (503) or not listening any more
        server.client().completions.create(model="lfm2_moe-demo", prompt="x", max_tokens=1)
    rc, out = server.stop()
    assert rc == 0, server.logs()[-2000:]
    assert out.strip().splitlines()[-1].startswith("kv pool idle: promised 0"), out


def test_a_chats_next_turn_resumes(tmp_path: Path) -> None:
    """The prompt store is on by default (sized by the plan, at least 4 states a lane, said in
    the plan line): the server passes the chat's turn marks to the engine, so the next turn's
    prompt is cached up to the last kept mark."""
    s = ServedDemo(tmp_path, "--parallel", "2")
    try:
        c = s.client()
        turn = [{"role": "user", "content": "Tell me a story about the little engine. " * 40}]
        first = c.chat.completions.create(
            model="lfm2_moe-demo", messages=turn, max_tokens=8, temperature=0
        )
        turn += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "And then?"},
        ]
        second = c.chat.completions.create(
            model="lfm2_moe-demo", messages=turn, max_tokens=8, temperature=0
        )
        assert second.usage is not None and second.usage.prompt_tokens_details is not None
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        m = s.wait_even()
        assert m["tensorfold_prompt_tokens_total{source=cached}"] > 0
        host = {k: v for k, v in m.items() if k.startswith("tensorfold_pool_host_pages{")}
        assert host["tensorfold_pool_host_pages{state=total}"] > 0  # the host tier is on too
        assert (
            host["tensorfold_pool_host_pages{state=free}"]
            + host["tensorfold_pool_host_pages{state=store}"]
            == host["tensorfold_pool_host_pages{state=total}"]
        )
        plan_line = next(line for line in s.printed if line.startswith("kv plan:"))  # stdout, once
        states = int(re.search(r"for (\d+) kept states", plan_line).group(1))
        assert states >= 4 * 2, plan_line
    finally:
        rc, _ = s.stop()
    assert rc == 0


@pytest.mark.parametrize(
    "flags,says",
    [
        (["--family", "nope"], "nope"),
        (["--family", FAMILY, "--parallel", "4096"], "--parallel"),
        (["--family", FAMILY, "--port", "70000"], "--port"),
    ],
)
def test_refusals_are_one_line_before_the_weights(
    tmp_path: Path, flags: list[str], says: str
) -> None:
    refused_before_the_weights(tmp_path, ["--port", "0", "--context", "4096", *flags], says)


def refused_before_the_weights(tmp_path: Path, args: list[str], says: str) -> None:
    """`tensorfold serve *args` (the demo cache in tmp_path, no TF_* settings) exits 2 with one
    error line that names `says`, before it loads weights or serves."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}
    env.update(TF_DEMO_CACHE=str(tmp_path / "demo"), TF_MEMORY_LIMIT_GIB="1")
    r = subprocess.run(
        [sys.executable, "-c", LAUNCH, "serve", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    errors = [line for line in r.stderr.splitlines() if line.startswith("tensorfold: error:")]
    assert r.returncode == 2 and len(errors) == 1 and says in errors[0], r.stderr
    assert "serving" not in r.stdout
