import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from structlog.testing import capture_logs

from tensorfold.family.checkpoint import Checkpoint, CheckpointError

A = torch.arange(12, dtype=torch.float32).reshape(3, 4)
B = torch.ones(5, dtype=torch.bfloat16)
C = torch.full((2, 2), 7, dtype=torch.float16)


def write_config(root: Path, **extra: object) -> None:
    root.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "tiny", "eos_token_id": 2, **extra}
    (root / "config.json").write_text(json.dumps(config))


@pytest.fixture
def single(tmp_path: Path) -> Path:
    write_config(tmp_path)
    save_file({"a": A, "b": B}, str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    write_config(tmp_path)
    save_file({"a": A, "b": B}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"c": C}, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {
        "a": "model-00001-of-00002.safetensors",
        "b": "model-00001-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors",
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tmp_path


def test_single_file(single: Path) -> None:
    ckpt = Checkpoint.open(single)
    assert ckpt.path == single
    assert ckpt.config["model_type"] == "tiny"
    assert ckpt.generation_config == {} and ckpt.tokenizer_config == {}
    assert sorted(ckpt.tensor_names()) == ["a", "b"]
    assert ckpt.has("a") and not ckpt.has("z")
    assert ckpt.shape("a") == (3, 4)
    a = ckpt.load("a")
    assert a.dtype == torch.float32 and torch.equal(a, A)
    assert ckpt.load("b").dtype == torch.bfloat16
    assert ckpt.total_bytes() == 12 * 4 + 5 * 2


def test_optional_configs_are_read(single: Path) -> None:
    (single / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    (single / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    ckpt = Checkpoint.open(str(single))
    assert ckpt.generation_config["eos_token_id"] == [2, 3]
    assert ckpt.tokenizer_config["eos_token"] == "</s>"


def test_sharded(sharded: Path) -> None:
    ckpt = Checkpoint.open(sharded)
    assert sorted(ckpt.tensor_names()) == ["a", "b", "c"]
    assert ckpt.shape("c") == (2, 2)
    assert torch.equal(ckpt.load("c"), C)
    got = ckpt.load_many(["c", "a"], dtype=torch.float32)
    assert list(got) == ["c", "a"]
    assert all(t.dtype == torch.float32 for t in got.values())
    assert torch.equal(got["c"], C.float())


def test_dtype_cast_and_shape_check(single: Path) -> None:
    ckpt = Checkpoint.open(single)
    assert ckpt.load("a", dtype=torch.bfloat16).dtype == torch.bfloat16
    assert ckpt.load("a", dtype="float16").dtype == torch.float16
    assert ckpt.load("a", shape=(3, 4)).shape == (3, 4)
    with pytest.raises(CheckpointError) as e:
        ckpt.load("a", shape=(4, 3))
    msg = str(e.value)
    assert "model.safetensors" in msg and "'a'" in msg and "[4, 3]" in msg and "[3, 4]" in msg


def test_progress_bar_only_on_a_terminal_else_log_lines(
    single: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = Checkpoint.open(single)
    with capture_logs() as logs:
        ckpt.load_many(["a", "b"])  # stderr is not a terminal here: log lines, no bar
    assert "it/s" not in capsys.readouterr().err
    lines = [e["event"] for e in logs if e["event"].startswith("loading weights")]
    assert lines[0] == "loading weights: 0 B of 58 B"
    assert lines[-1] == "loading weights: 58 B of 58 B, 2/2 tensors"
    ckpt.load_many(["a", "b"], progress=True)
    err = capsys.readouterr().err
    assert "loading weights: 100%" in err and "2/2 tensors" in err and err.endswith("\n")


def test_a_load_that_leaves_unused_tensors_is_not_stopped(single: Path) -> None:
    """A family that reads only the tensors it uses (GLM's demo leaves its vision tower) ends
    with a line that says so, not "(stopped)"; a load that fails part way says "(stopped)"."""
    ckpt = Checkpoint.open(single)
    with capture_logs() as logs, ckpt.loading():
        ckpt.load("a")
    last = [e["event"] for e in logs if e["event"].startswith("loading weights")][-1]
    assert "stopped" not in last and "1 the model does not use were not read" in last
    with capture_logs() as logs, pytest.raises(RuntimeError), ckpt.loading():
        ckpt.load("a")
        raise RuntimeError("a load that fails")
    assert [e["event"] for e in logs][-1].endswith("(stopped)")


def test_a_loading_inside_the_cores_adds_no_line(single: Path) -> None:
    """A family's own `with checkpoint.loading():` (or load_many) inside the core's one counts
    into the core's: one progress, ending whole, no "0 B of ... (stopped)" beside it."""
    ckpt = Checkpoint.open(single)
    with capture_logs() as logs, ckpt.loading():
        with ckpt.loading():
            ckpt.load("a")
        ckpt.load_many(["b"])
    lines = [e["event"] for e in logs if e["event"].startswith("loading weights")]
    assert lines[0] == "loading weights: 0 B of 58 B" and lines.count(lines[0]) == 1
    assert lines[-1] == "loading weights: 58 B of 58 B, 2/2 tensors"
    assert not [line for line in lines if "stopped" in line]


def test_progress_follows_isatty(single: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty:
        def __init__(self) -> None:
            self.parts: list[str] = []

        def isatty(self) -> bool:
            return True

        def write(self, s: str) -> None:
            self.parts.append(s)

        def flush(self) -> None:
            pass

    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    with capture_logs() as logs:
        Checkpoint.open(single).load_many(["a"])
    assert "1/1 tensors" in "".join(tty.parts) and "100%" in "".join(tty.parts)
    assert logs == []


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="nowhere.*does not exist"):
        Checkpoint.open(tmp_path / "nowhere")


def test_missing_config(tmp_path: Path) -> None:
    save_file({"a": A}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"config\.json not found"):
        Checkpoint.open(tmp_path)


def test_bad_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": ')
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON: .*line 1"):
        Checkpoint.open(tmp_path)


def test_bad_optional_json_names_file(single: Path) -> None:
    (single / "generation_config.json").write_text("nope")
    with pytest.raises(CheckpointError, match=r"generation_config\.json is not valid JSON"):
        Checkpoint.open(single)


def test_no_weights(tmp_path: Path) -> None:
    write_config(tmp_path)
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(tmp_path)
    assert "model.safetensors" in str(e.value) and "model.safetensors.index.json" in str(e.value)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pth"])
def test_pickles_refused(tmp_path: Path, name: str) -> None:
    write_config(tmp_path)
    marker = tmp_path / "executed"
    # A real pickle that would create `marker` if it were ever unpickled.
    import pickle

    class Boom:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (Path.touch, (str(marker),))  # type: ignore[return-value]

    (tmp_path / name).write_bytes(pickle.dumps(Boom()))
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(tmp_path)
    msg = str(e.value)
    assert name in msg and "only safetensors" in msg
    assert "Nothing in a checkpoint is ever executed" in msg
    assert not marker.exists()


def test_safetensors_preferred_over_pickles(single: Path) -> None:
    (single / "pytorch_model.bin").write_bytes(b"junk")
    assert Checkpoint.open(single).has("a")


def test_index_names_missing_shard(sharded: Path) -> None:
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(sharded)
    msg = str(e.value)
    assert "model.safetensors.index.json" in msg and "model-00002-of-00002.safetensors" in msg
    assert "'c'" in msg


def test_index_shard_outside_folder_refused(sharded: Path) -> None:
    index = {"weight_map": {"a": "../elsewhere.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="elsewhere"):
        Checkpoint.open(sharded)


def test_truncated_file(single: Path) -> None:
    path = single / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"model\.safetensors is corrupt or truncated"):
        Checkpoint.open(single)


@pytest.mark.parametrize(
    "blob", [b"", b"\x01\x02", b"\xff" * 64, (4).to_bytes(8, "little") + b"{{{{"]
)
def test_corrupt_file(single: Path, blob: bytes) -> None:
    (single / "model.safetensors").write_bytes(blob)
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        Checkpoint.open(single)


def test_missing_tensor_names_tensor_and_files(sharded: Path) -> None:
    ckpt = Checkpoint.open(sharded)
    with pytest.raises(CheckpointError) as e:
        ckpt.load("model.layers.0.nope")
    msg = str(e.value)
    assert "'model.layers.0.nope'" in msg
    assert "model-00001-of-00002.safetensors" in msg and "model-00002-of-00002.safetensors" in msg
    with pytest.raises(CheckpointError, match="nope"):
        ckpt.shape("model.layers.0.nope")


def test_index_points_at_wrong_shard(sharded: Path) -> None:
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    index["weight_map"]["c"] = "model-00001-of-00002.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = Checkpoint.open(sharded)
    with pytest.raises(CheckpointError) as e:
        ckpt.load("c")
    assert "'c'" in str(e.value) and "model-00001-of-00002.safetensors" in str(e.value)


def test_opening_a_file_is_refused(single: Path) -> None:
    with pytest.raises(CheckpointError, match="is not a folder"):
        Checkpoint.open(single / "config.json")


def test_loading_shows_a_progress_line_and_ends_it(tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    from tensorfold.family.checkpoint import Checkpoint

    (tmp_path / "config.json").write_text("{}")
    save_file({"a": torch.zeros(4, 4), "b": torch.ones(8)}, str(tmp_path / "model.safetensors"))
    ckpt = Checkpoint.open(tmp_path)
    with ckpt.loading(progress=True):
        ckpt.load("a")
        ckpt.load("b")
    err = capsys.readouterr().err
    assert "loading weights: 100%" in err and "2/2 tensors" in err and err.endswith("\n")
    with capture_logs() as logs, ckpt.loading(progress=False):
        ckpt.load("a")
    assert capsys.readouterr().err == "" and logs == []
