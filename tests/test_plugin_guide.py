"""docs/plugins.md's plugin runs as written: its file blocks are written into a temporary folder,
the plugin is installed there the way pip records an install (a .dist-info folder with the
pyproject's entry points, on the path), and then, in fresh interpreters that find it through the
`tensorfold` entry-point group: `tensorfold families` lists it, `tensorfold serve` serves its
demo to an OpenAI client (the family chosen from the demo's config.json beside lfm2_moe), and
the plugin's own tests pass (parity with transformers 5.23.0 in fp32, a llama3 `rope_scaling`
checkpoint applied and a yarn one refused, testing.greedy's pages, the pass-level gates, the
engine gates, and two tensor-parallel ranks on the CPU). In this process, a plain `x @ w.T` and
`F.silu` planted in the guide's model fail its pass-level gate at the guide's odd widths."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest
import torch
from guide_blocks import check_blocks, file_blocks, write_blocks

GUIDE = Path(__file__).parents[1] / "docs" / "plugins.md"
LAUNCH = "import sys; from tensorfold.cli.commands import main; sys.exit(main())"


def install_in_place(project: Path, site: Path) -> str:
    """Record `project` (a folder with pyproject.toml) as installed into `site`: its packages are
    importable from `project` and its entry points are read from a dist-info, as pip would write
    them. Returns the distribution's name."""
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    dist = site / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n"
    )
    lines = [
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
        for group, eps in meta.get("entry-points", {}).items()
    ]
    (dist / "entry_points.txt").write_text("\n".join(lines))
    return meta["name"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The guide's project folder, and an environment in which its plugin is installed (and no
    other: TF_PLUGINS names it alone)."""
    root = tmp_path_factory.mktemp("guide")
    write_blocks(GUIDE.read_text(), root)
    project = root / "tiny_dense"
    site = root / "site"
    assert install_in_place(project, site) == "tensorfold-tiny-dense"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}
    env["PYTHONPATH"] = os.pathsep.join([str(project), str(site)])
    env["TF_PLUGINS"] = "tiny_dense"
    env["TF_DEMO_CACHE"] = str(root / "demo")
    return project, env


def guide_module(project: Path, name: str, package: str = "tensorfold_tiny_dense"):
    """`package.name` from `project`, imported in this process under its own name."""
    sys.path.insert(0, str(project))
    try:
        return importlib.import_module(f"{package}.{name}")
    finally:
        sys.path.remove(str(project))


@pytest.fixture(scope="module")
def demo(installed, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The guide's demo checkpoint, built by its demo.py (which imports no other guide file)."""
    project, _ = installed
    path = project / "tensorfold_tiny_dense" / "demo.py"
    spec = importlib.util.spec_from_file_location("tiny_dense_guide_demo", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_demo(tmp_path_factory.mktemp("guide_demo"))


def test_the_guide_names_its_files() -> None:
    files = set(file_blocks(GUIDE.read_text()))
    assert {
        "tiny_dense/pyproject.toml",
        "tiny_dense/tensorfold_tiny_dense/plugin.py",
        "tiny_dense/tensorfold_tiny_dense/model.py",
        "tiny_dense/tensorfold_tiny_dense/demo.py",
        "tiny_dense/tests/test_parity.py",
        "tiny_dense/tests/test_engine.py",
        "tiny_dense/tensorfold_tiny_dense/shards.py",
        "tiny_dense/tests/test_tp.py",
    } <= files


def test_the_profile_rows_snippet_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next-steps snippet registers its row and reads its setting."""
    from tensorfold.family.plugins import PluginManager

    (snippet,) = check_blocks(GUIDE.read_text())
    monkeypatch.setenv("TF_TINY_DENSE_WINDOW", "64")
    namespace: dict = {}
    exec(compile(snippet, "docs/plugins.md", "exec"), namespace)
    assert namespace["window"]() == 64
    pm = PluginManager()
    pm.register(type("Plugin", (), {"profile_rows": staticmethod(namespace["profile_rows"])}))
    rows: list = []
    pm.hook.profile_rows(register=rows.append)
    assert [r.setting for r in rows] == ["TF_TINY_DENSE_WINDOW"]


def test_the_installed_family_is_listed(installed) -> None:
    project, env = installed
    families = subprocess.run(
        [sys.executable, "-c", LAUNCH, "families"],
        env=env,
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert families.returncode == 0, families.stderr
    assert "tiny_dense" in families.stdout and "tensorfold-tiny-dense" in families.stdout


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_serve_answers_a_chat_with_the_demo(installed, demo: Path) -> None:
    """Without --family, beside lfm2_moe (the default of several), the demo's config.json
    (model_type "llama") chooses tiny_dense, which serves it."""
    project, env = installed
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            LAUNCH,
            "serve",
            "--model",
            str(demo),
            "--port",
            "0",
            "--parallel",
            "2",
        ],
        env={**env, "TF_PLUGINS": "tiny_dense,lfm2_moe", "TF_MEMORY_LIMIT_GIB": "0.5"},
        cwd=project,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline, url, start_lines = time.monotonic() + 120, None, ""
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            start_lines += line
            if not line:
                break
            if line.startswith("serving "):
                url = line.split(" at ")[-1].strip()
        assert url, proc.stderr.read() if proc.poll() is not None else "no address printed"
        for _ in range(100):
            try:
                with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=5):
                    break
            except OSError:
                time.sleep(0.05)
        with urllib.request.urlopen(url + "/models", timeout=60) as r:
            (served,) = json.loads(r.read())["data"]
        ask = {
            "model": served["id"],
            "max_tokens": 6,
            "temperature": 0,
            "seed": 1,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        }
        first = _post(url + "/chat/completions", ask)
        assert first["choices"][0]["finish_reason"] in ("length", "stop")
        assert first["usage"]["completion_tokens"] >= 1
        assert _post(url + "/chat/completions", ask)["choices"] == first["choices"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            said = "".join(proc.communicate(timeout=60))
        except subprocess.TimeoutExpired:
            proc.kill()
            said = "".join(proc.communicate())
    chosen = "family tiny_dense, which serves the checkpoint's model_type 'llama'"
    assert chosen in start_lines + said, (start_lines + said)[-3000:]


# What a third-party author may write in place of the library's ops: (guide text, planted text)
PLANTS = {
    "matmul": (
        "from tensorfold.ops.linear import linear\n",
        "def linear(x, w):  # planted: the BLAS picks its kernel by row count\n    return x @ w.T\n",
    ),
    "silu": (
        'f = gated_ffn(x, lw["gate"], lw["up"], lw["down"], act="silu")',
        'f = linear(torch.nn.functional.silu(linear(x, lw["gate"])) * linear(x, lw["up"]), '
        'lw["down"])  # planted: F.silu rounds a tensor\'s tail otherwise',
    ),
}


def test_the_guides_widths_make_the_pass_gate_catch_plain_torch(installed, demo, tmp_path) -> None:
    """The guide's model passes `assert_streams_together_equal_alone` on its demo; the same model
    with a plain `x @ w.T`, or a plain `F.silu`, fails it wherever that op gives a row other bits
    beside other rows (at the demo's widths, 72 and 118, on the CPUs we run: both)."""
    from tensorfold import testing
    from tensorfold.family.checkpoint import Checkpoint

    project, _ = installed
    prompt = torch.randint(3, 320, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = [prompt[:150], prompt, prompt[40:190]]

    def gate(package: str) -> None:
        model = guide_module(tmp_path, "model", package).load(
            Checkpoint.open(demo), "cpu", "float32"
        )
        testing.assert_streams_together_equal_alone(
            testing.runner_factory(model), model, prompts, [0, 1, 2], num_pages=8, max_rows=200
        )

    for name, (guide, planted) in {"guide": ("", ""), **PLANTS}.items():
        package = f"tiny_dense_{name}"
        shutil.copytree(project / "tensorfold_tiny_dense", tmp_path / package)
        model_py = tmp_path / package / "model.py"
        text = model_py.read_text()
        assert guide in text, f"the guide's model no longer holds {guide!r}"
        model_py.write_text(text.replace(guide, planted))
        if name == "guide":
            gate(package)
            continue
        try:
            gate(package)
        except AssertionError as caught:
            assert "changed beside streams" in str(caught), caught
        else:  # passed: only right where the planted op gives a row the same bits in any batch
            assert not rows_vary(name), f"the gate missed the planted {name}"


def rows_vary(plant: str) -> bool:
    """Whether the planted op gives a row other bits beside other rows than alone, on this CPU
    (a CPU kernel without vector code, ATEN_CPU_CAPABILITY=default, computes F.silu alike in
    any tensor; a BLAS may keep some sizes' products row-invariant): at the guide's widths."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(150, 72, generator=gen)
    if plant == "matmul":
        w = torch.randn(118, 72, generator=gen)
        both = x @ w.T
        return any(not torch.equal(both[i : i + 1], x[i : i + 1] @ w.T) for i in range(150))
    h = torch.randn(150, 118, generator=gen)
    both = torch.nn.functional.silu(h)
    return any(
        not torch.equal(both[i], torch.nn.functional.silu(h[i : i + 1])[0]) for i in range(150)
    )


@pytest.mark.timeout(600)
def test_the_guides_plugin_passes_its_own_tests(installed) -> None:
    pytest.importorskip("transformers", reason="transformers 5.23.0 is the parity reference")
    project, env = installed
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        env=env,
        cwd=project,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
