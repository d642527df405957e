"""A Hugging Face checkpoint folder: config files and safetensors weights.

Only safetensors are read; nothing in a checkpoint is ever executed (no pickles, no remote code).
Headers are parsed at open, so a missing or corrupt shard is reported before any weight loads.
torch is imported only when a tensor is loaded.

fp8 weights (docs/fp8.md): config.json's quantization_config is read at open (an unknown
format is refused there). A family reads its linears with `TensorReader.linear` (or `.experts`
for a stack): an fp8 tensor on disk comes as an `Fp8Weight` (its scales read beside it, the
format's business alone), and under `--quantization fp8` (`set_quantization`) a model-dtype
linear the family's `FamilySpec.fp8_linears` names is quantized as it loads. Any other read of
an fp8 tensor (a router, an absorbed weight) is dequantized to the dtype asked.
"""

from __future__ import annotations

import contextlib
import json
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

from .fp8_formats import Fp8Format, QuantizationRefused, fp8_format
from .spec import Shard, ShardRefused, block

if TYPE_CHECKING:
    import torch

    from .fp8_weights import Fp8Weight

FP8_CODE = "F8_E4M3"  # safetensors' dtype code of float8 e4m3fn
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(Exception):
    """A checkpoint folder cannot be read; the message names the file (and tensor) at fault."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors dtype code: "BF16", "F32", ...
    shape: tuple[int, ...]
    nbytes: int


def read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path.name} not found in {path.parent}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse a safetensors header (u64 length, JSON) and check each tensor lies inside the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path} is not a safetensors file: shorter than its header")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER):
                raise CheckpointError(
                    f"{path} is corrupt or truncated: header claims {n} bytes, file has {size}"
                )
            raw = json.loads(f.read(n).decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is corrupt: its header is not valid JSON ({e})") from None
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} is corrupt: its header is not a JSON object")
    data_bytes = size - 8 - n
    infos: dict[str, TensorInfo] = {}
    for name, entry in raw.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            shape = tuple(int(d) for d in entry["shape"])
            info = TensorInfo(path, str(entry["dtype"]), shape, end - begin)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path} is corrupt: bad header entry for {name!r}") from None
        if not 0 <= begin <= end <= data_bytes:
            raise CheckpointError(
                f"{path} is corrupt or truncated: tensor {name!r} needs bytes {begin}..{end}, "
                f"the file holds {data_bytes}"
            )
        infos[name] = info
    return infos


def torch_dtype(dtype: "torch.dtype | str") -> "torch.dtype":
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return found


class Checkpoint:
    """A checkpoint folder. Build with `Checkpoint.open(path)`."""

    def __init__(
        self,
        path: Path,
        config: dict[str, Any],
        generation_config: dict[str, Any],
        tokenizer_config: dict[str, Any],
        index: dict[str, Path],
        headers: dict[Path, dict[str, TensorInfo]],
    ) -> None:
        self.path = path
        self.config = config
        self.generation_config = generation_config
        self.tokenizer_config = tokenizer_config
        self._index = index  # tensor name -> the file the index (or the single file) places it in
        self._headers = headers
        self._handles: dict[tuple[Path, str], Any] = {}
        self._progress: list[Any] | None = None  # [Progress, tensors done, tensors] in loading()
        self.shard = Shard()  # tensor parallel: which rank this is, and how tensors are cut
        try:
            self.fp8: Fp8Format | None = fp8_format(config)  # how fp8 tensors are stored
        except QuantizationRefused as e:
            raise CheckpointError(f"{path / 'config.json'}: {e}") from None
        self.fp8_linears: re.Pattern[str] | None = None  # set_quantization: the family's linears
        self.quantize_at_load = False  # set_quantization: --quantization fp8
        self.quantized: list[str] = []  # the tensors loaded as Fp8Weight, in order
        self._scales = self._fp8_scales()

    @classmethod
    def open(cls, path: str | Path, weights: bool = True) -> "Checkpoint":
        """weights=False reads the configs only (a dummy load format); it holds no tensors."""
        root = Path(path).expanduser()
        if not root.is_dir():
            what = "is not a folder" if root.exists() else "does not exist"
            raise CheckpointError(f"checkpoint folder {root} {what}")
        config = read_json(root / "config.json", required=True)
        generation_config = read_json(root / "generation_config.json", required=False)
        tokenizer_config = read_json(root / "tokenizer_config.json", required=False)
        if not weights:
            return cls(root, config, generation_config, tokenizer_config, {}, {})
        index, files = cls._find_weights(root)
        headers = {f: read_header(f) for f in files}
        if not index:  # single file: its header is the index
            index = {name: f for f in files for name in headers[f]}
        return cls(root, config, generation_config, tokenizer_config, index, headers)

    @staticmethod
    def _find_weights(root: Path) -> tuple[dict[str, Path], list[Path]]:
        if (root / SINGLE_FILE).is_file():
            return {}, [root / SINGLE_FILE]
        index_path = root / INDEX_FILE
        if index_path.is_file():
            weight_map = read_json(index_path, required=True).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index_path} has no 'weight_map' naming tensors and shards")
            index: dict[str, Path] = {}
            for name, shard in weight_map.items():
                shard_path = root / str(shard)
                if Path(str(shard)).name != str(shard) or not shard_path.is_file():
                    raise CheckpointError(
                        f"{index_path} maps tensor {name!r} to shard {shard!r}, "
                        f"which is not a file in {root}"
                    )
                index[name] = shard_path
            return index, sorted(set(index.values()))
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(
                f"{root} holds only pickle weights ({', '.join(pickles)}); tensorfold loads only "
                "safetensors, because unpickling executes code from the file. Nothing in a "
                "checkpoint is ever executed: convert it to safetensors first."
            )
        raise CheckpointError(f"no weights in {root}: looked for {SINGLE_FILE} and {INDEX_FILE}")

    # --- names and shapes, without loading ---

    def tensor_names(self) -> list[str]:
        return list(self._index)

    def has(self, name: str) -> bool:
        return name in self._index

    def info(self, name: str) -> TensorInfo:
        file = self._index.get(name)
        if file is None:
            searched = ", ".join(sorted(f.name for f in self._headers))
            raise CheckpointError(f"tensor {name!r} not found in {self.path} (searched {searched})")
        info = self._headers[file].get(name)
        if info is None:
            raise CheckpointError(
                f"tensor {name!r} not found in {file} (searched {file.name}, "
                f"where {INDEX_FILE} places it)"
            )
        return info

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def total_bytes(self) -> int:
        """Bytes of all indexed tensors as stored (before any dtype cast)."""
        return sum(self.info(name).nbytes for name in self._index)

    # --- fp8 ---

    def set_quantization(self, fp8_linears: str, at_load: bool = True) -> None:
        """The family's linears: the on-disk names the regular expression `fp8_linears` finds
        (its FamilySpec.fp8_linears). `at_load` (--quantization fp8): those stored in a model
        dtype are quantized to 128 x 128 block scales as they load. Either way the plan counts
        a stored fp8 tensor the pattern does not name as dequantized (2 bytes a value)."""
        self.fp8_linears = re.compile(fp8_linears) if fp8_linears else None
        self.quantize_at_load = at_load

    def stored_fp8(self, name: str) -> bool:
        """Whether `name` is stored as float8 e4m3 (its scales beside it)."""
        return self.info(name).dtype == FP8_CODE

    def quantizes_at_load(self, name: str) -> bool:
        """Whether `name`, stored in a model dtype, is quantized as it loads."""
        return self.quantize_at_load and self._declared(name) and not self.stored_fp8(name)

    def _declared(self, name: str) -> bool:
        return self.fp8_linears is not None and self.fp8_linears.search(name) is not None

    def _fp8_scales(self) -> set[str]:
        """The scale tensors of the fp8 weights (read with their weight, never cut on their
        own). An fp8 tensor needs a quantization_config, and its scale, to load."""
        # a tensor the index misplaces is reported when it loads, not here
        found = ((n, self._headers[f].get(n)) for n, f in self._index.items())
        fp8 = [n for n, info in found if info is not None and info.dtype == FP8_CODE]
        if fp8 and self.fp8 is None:
            raise CheckpointError(
                f"{self.path}: tensor {fp8[0]!r} is stored in fp8 but config.json has no "
                "quantization_config saying how it is scaled"
            )
        return {self.fp8.scale_name(n) for n in fp8} & set(self._index) if self.fp8 else set()

    # --- tensor parallel: each rank reads its slice ---

    def set_shard(self, shard: Shard) -> None:
        """Read tensors as rank `shard.rank` of `shard.world` (each as `shard.plan` cuts it).
        Checks that every tensor can be cut, so a refusal comes before any weight loads."""
        self.shard = shard
        for name in self._index:
            if name not in self._scales:
                self._pieces(name)

    def _pieces(self, name: str) -> tuple[int, list[tuple[int, int]]] | None:
        """(dim, ranges along dim) of this rank's slice of `name`; None: the whole tensor;
        (0, []) for another rank's expert (nothing to read)."""
        if name in self._scales:
            return None
        return shard_pieces(self.shard, name, self.info(name).shape)

    def local_shape(self, name: str) -> tuple[int, ...] | None:
        """The shape of this rank's slice of `name` (its full shape at one rank); None for
        another rank's expert."""
        shape = list(self.shape(name))
        pieces = self._pieces(name)
        if pieces is not None:
            dim, ranges = pieces
            if not ranges:
                return None
            shape[dim] = sum(b - a for a, b in ranges)
        return tuple(shape)

    def local_bytes(self, as_stored: bool = False) -> int:
        """Bytes this rank holds (its slices; all tensors at one rank), as stored; unless
        `as_stored` (the bytes read), a tensor quantized at load counts its fp8 bytes and scales
        (fp8_weights.fp8_bytes), and an fp8 one the family reads plain its dequantized bytes."""
        from .fp8_weights import fp8_bytes

        total = 0
        for name in self._index:
            info = self.info(name)
            shape = self.local_shape(name)
            if shape is None or not _numel(info.shape):
                continue
            full = info.nbytes
            if as_stored:
                pass
            elif self.quantizes_at_load(name):
                full = fp8_bytes(info.shape)
            elif (
                self.fp8_linears is not None and info.dtype == FP8_CODE and not self._declared(name)
            ):
                full = 2 * _numel(info.shape)  # dequantized as it loads (in bf16 on the GPU)
            total += full * _numel(shape) // _numel(info.shape)
        return total

    # --- loading ---

    def load(
        self,
        name: str,
        *,
        device: str = "cpu",
        dtype: "torch.dtype | str | None" = None,
        shape: Sequence[int] | None = None,
    ) -> "torch.Tensor":
        """Read one tensor straight to `device`; cast to `dtype` (None keeps the stored dtype) and
        check `shape` if given: the whole tensor's shape on disk. Under tensor parallel the
        tensor returned is this rank's slice (see `set_shard`); another rank's expert raises."""
        info = self.info(name)
        if shape is not None and tuple(shape) != info.shape:
            raise CheckpointError(
                f"tensor {name!r} in {info.file} has shape {list(info.shape)}, "
                f"expected {list(shape)}"
            )
        if self.stored_fp8(name):  # read as a plain tensor: dequantized (fp32 without dtype)
            return self.load_fp8(name, device=device).dequantize(torch_dtype(dtype or "float32"))
        if self.quantizes_at_load(name):
            raise CheckpointError(
                f"tensor {name!r} is read as a plain tensor, but the family's fp8_linears "
                "names it (a linear is read with TensorReader.linear)"
            )
        return self._read(name, info, device, dtype)

    def _read(
        self, name: str, info: TensorInfo, device: str, dtype: "torch.dtype | str | None"
    ) -> "torch.Tensor":
        pieces = self._pieces(name)
        if pieces is not None and not pieces[1]:
            raise CheckpointError(f"tensor {name!r} belongs to another rank's experts")
        try:
            handle = self._handle(info.file, device)
            tensor = (
                handle.get_tensor(name)
                if pieces is None
                else _read_slices(handle.get_slice(name), len(info.shape), *pieces)
            )
        except Exception as e:  # safetensors raises its own error type for bad data
            raise CheckpointError(f"cannot load tensor {name!r} from {info.file}: {e}") from None
        read = info.nbytes
        if pieces is not None:
            read = info.nbytes * tensor.numel() // max(1, _numel(info.shape))
        if dtype is not None:
            tensor = tensor.to(torch_dtype(dtype))
        self._count(read)
        return tensor

    def load_fp8(
        self, name: str, *, device: str = "cpu", shape: Sequence[int] | None = None
    ) -> "Fp8Weight":
        """`name` as an Fp8Weight (this rank's slice under tensor parallel): from its stored
        e4m3 values and scales, or quantized to 128 x 128 blocks as it loads. `shape`: the
        whole tensor's shape on disk, checked."""
        import torch

        from .fp8_weights import Fp8Weight, narrow_scale, quantize_blocks

        info = self.info(name)
        if shape is not None and tuple(shape) != info.shape:
            raise CheckpointError(
                f"tensor {name!r} in {info.file} has shape {list(info.shape)}, "
                f"expected {list(shape)}"
            )
        pieces = self._pieces(name)
        if pieces is not None and not pieces[1]:
            raise CheckpointError(f"tensor {name!r} belongs to another rank's experts")
        if not self.stored_fp8(name):  # quantized whole, then cut: as an FP8 checkpoint cuts
            whole = self._whole(name, info, device)
            weight = quantize_blocks(whole)
            del whole
            return self._cut(name, weight, pieces)
        assert self.fp8 is not None  # _fp8_scales refused fp8 tensors without a format
        scale_name = self.fp8.scale_name(name)
        if scale_name not in self._index:
            raise CheckpointError(
                f"fp8 tensor {name!r} in {info.file} has no scale {scale_name!r} "
                f"({self.fp8.method} checkpoints store one beside each weight)"
            )
        scale = self._whole(scale_name, self.info(scale_name), device).to(torch.float32)
        scale, block = self._scale_block(name, info.shape, scale)
        q = self._read(name, info, device, None)
        if pieces is None:
            return Fp8Weight(q, scale, block)
        dim, ranges = pieces
        lead = len(info.shape) - 2
        parts, at = [], 0
        for a, b in ranges:  # each range's scales, beside the q piece read for it
            if dim < lead:  # an expert dimension: the scales are cut as q is
                sub, blk, row0 = scale.narrow(dim, a, b - a), block, 0
            else:
                sub, blk, row0 = narrow_scale(scale, block, info.shape, dim - lead, a, b - a)
            parts.append(Fp8Weight(q.narrow(dim, at, b - a), sub, blk, row0))
            at += b - a
        return self._join(name, parts, dim, len(info.shape))

    def _whole(self, name: str, info: TensorInfo, device: str) -> "torch.Tensor":
        """The whole tensor as stored, whatever this rank's slice of it."""
        try:
            tensor = self._handle(info.file, device).get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"cannot load tensor {name!r} from {info.file}: {e}") from None
        self._count(info.nbytes)
        return tensor

    def _cut(
        self, name: str, weight: "Fp8Weight", pieces: tuple[int, list[tuple[int, int]]] | None
    ) -> "Fp8Weight":
        if pieces is None:
            return weight
        dim, ranges = pieces
        lead = weight.q.dim() - 2
        if dim < lead:  # experts: cut q and scales alike
            parts = [
                replace(
                    weight,
                    q=weight.q.narrow(dim, a, b - a),
                    scale=weight.scale.narrow(dim, a, b - a),
                )
                for a, b in ranges
            ]
        else:
            parts = [weight.narrow(dim - lead, a, b - a) for a, b in ranges]
        if len(parts) == 1:  # a view would hold the whole tensor: keep this rank's bytes only
            one = parts[0]
            return replace(one, q=one.q.contiguous().clone(), scale=one.scale.clone())
        return self._join(name, parts, dim, weight.q.dim())

    def _join(self, name: str, parts: list["Fp8Weight"], dim: int, ndim: int) -> "Fp8Weight":
        import torch

        from .fp8_weights import Fp8Weight, cat_rows

        if len(parts) == 1:
            return parts[0]
        if dim < ndim - 2:
            return replace(
                parts[0],
                q=torch.cat([p.q for p in parts], dim),
                scale=torch.cat([p.scale for p in parts], dim),
            )
        if dim == ndim - 2 and ndim == 2:
            joined = cat_rows(parts)
            assert isinstance(joined, Fp8Weight)
            return joined
        raise ShardRefused(
            f"fp8 tensor {name!r}: a tensor-parallel cut in several pieces along "
            f"dimension {dim} is not supported"
        )

    def _scale_block(
        self, name: str, shape: tuple[int, ...], scale: "torch.Tensor"
    ) -> tuple["torch.Tensor", tuple[int, int]]:
        """The scales as [..., N/bn, K/bk] and their block, from the format's block or (per
        tensor, per channel) from the scale's shape; a shape that fits neither is refused."""
        lead, (n, k) = shape[:-2], shape[-2:]
        fmt = self.fp8
        assert fmt is not None
        if fmt.block is not None:
            bn, bk = fmt.block
            want = (*lead, -(-n // bn), -(-k // bk))
            if tuple(scale.shape) == want:
                return scale, (bn, bk)
        else:
            count = scale.numel()
            lead_count = _numel(lead)
            if count == lead_count:  # one scale a tensor (a stack: one an expert)
                return scale.reshape(*lead, 1, 1), (n, k)
            if count == lead_count * n and (scale.shape[-1] == 1 or scale.dim() == len(lead) + 1):
                return scale.reshape(*lead, n, 1), (1, k)
        raise CheckpointError(
            f"fp8 tensor {name!r} {list(shape)} has scales {list(scale.shape)}, which fit "
            f"neither its {fmt.method} block {fmt.block} nor one a tensor or a channel"
        )

    def _count(self, nbytes: int) -> None:
        if self._progress is not None:
            self._progress[1] += 1
            self._progress[0].note(f"{self._progress[1]}/{self._progress[2]} tensors")
            self._progress[0].update(nbytes)

    @contextlib.contextmanager
    def loading(
        self, progress: bool | None = None, names: Sequence[str] | None = None
    ) -> Iterator[None]:
        """While a family loads its weights (or the tensors `names`): progress in bytes and
        tensors (tensorfold.config.progress): a bar on stderr when it is a terminal, else a few log
        lines (progress=None); always the bar (True); nothing (False: a tensor-parallel
        follower, whose rank 0 shows it). Inside another `loading()` (the core's, around the
        family's `load`) it adds nothing: the outer one counts the reads."""
        if progress is False or self._progress is not None:
            yield
            return
        from ..config.progress import Progress

        if names is None:
            tensors = sum(1 for n in self._index if self.local_shape(n) is not None)
            nbytes = self.local_bytes(as_stored=True)
        else:
            tensors, nbytes = len(names), sum(self.info(n).nbytes for n in names)
        bar = Progress("loading weights", nbytes, "B", show=progress)
        counts: list[Any] = [bar, 0, tensors]
        self._progress = counts
        try:
            yield
        except BaseException:
            bar.close()  # "(stopped)": the load failed part way
            raise
        else:
            read = counts[1]
            if read < tensors:  # tensors the family does not use (a vision tower, an MTP layer)
                bar.note(f"{read} tensors; {tensors - read} the model does not use were not read")
            bar.close(finished=True)
        finally:
            self._progress = None

    def load_many(
        self,
        names: Iterable[str],
        *,
        device: str = "cpu",
        dtype: "torch.dtype | str | None" = None,
        progress: bool | None = None,
    ) -> dict[str, "torch.Tensor"]:
        """Load several tensors, file by file, with progress as `loading(progress)` shows it."""
        wanted = list(dict.fromkeys(names))
        infos = {n: self.info(n) for n in wanted}
        order = sorted(wanted, key=lambda n: (infos[n].file, n))
        out: dict[str, torch.Tensor] = {}
        with self.loading(progress, order):
            for name in order:
                out[name] = self.load(name, device=device, dtype=dtype)
        return {n: out[n] for n in wanted}

    def _handle(self, file: Path, device: str) -> Any:
        key = (file, str(device))
        handle = self._handles.get(key)
        if handle is None:
            from safetensors import safe_open

            try:
                handle = safe_open(str(file), framework="pt", device=str(device))
            except Exception as e:
                raise CheckpointError(f"{file} cannot be opened as safetensors: {e}") from None
            self._handles[key] = handle
        return handle

    def close(self) -> None:
        """Drop open file handles (memory maps); later loads reopen them."""
        self._handles.clear()

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, {len(self._index)} tensors)"


class TensorReader:
    """A family loader's reads: `read(name, *shape)` is `prefix + name` on `device` in `dtype`
    (another with `dtype=`), its shape on disk checked."""

    def __init__(self, ckpt: Checkpoint, device: str, dtype: "torch.dtype", prefix: str = ""):
        self.ckpt, self.device, self.dtype, self.prefix = ckpt, device, dtype, prefix

    def __call__(
        self, name: str, *shape: int, dtype: "torch.dtype | None" = None
    ) -> "torch.Tensor":
        return self.ckpt.load(
            self.prefix + name, device=self.device, dtype=dtype or self.dtype, shape=shape
        )

    def linear(self, name: str, *shape: int) -> "torch.Tensor | Fp8Weight":
        """A linear's weight [N, K] (or a stack [E, N, K]): an Fp8Weight when it is stored in
        fp8 or quantized at load (Checkpoint.set_quantization), else as `read(name, *shape)`."""
        full = self.prefix + name
        if self.ckpt.stored_fp8(full) or self.ckpt.quantizes_at_load(full):
            weight = self.ckpt.load_fp8(full, device=self.device, shape=shape)
            self.ckpt.quantized.append(full)
            return weight
        return self(name, *shape)

    def experts(self, names: Sequence[str], rows: int, cols: int) -> "torch.Tensor | Fp8Weight":
        """The experts' [rows, cols] linears `names` as one stack [E, rows, cols] (what the
        grouped kernels take), filled one expert at a time: no second copy of a layer's
        experts on the device. fp8 experts (all or none) stack their values and scales."""
        from .fp8_weights import empty_stack, put

        stack: torch.Tensor | Fp8Weight | None = None
        for e, name in enumerate(names):
            one = self.linear(name, rows, cols)
            if stack is None:
                stack = empty_stack(one, len(names))
            try:
                put(stack, e, one)
            except ValueError as err:
                raise CheckpointError(f"expert {self.prefix + name!r}: {err}") from None
        assert stack is not None, "experts: no names"
        return stack

    def upcast(self, name: str, *shape: int) -> "torch.Tensor":
        """Stored in the model dtype, used in fp32 (the reference's `.float()` in the op)."""
        return self(name, *shape).float()

    def bias(self, name: str, size: int, present: bool) -> "torch.Tensor | None":
        return self(name, size) if present else None

    def lm_head(self, embed: "torch.Tensor", ties: bool, split_vocab: bool) -> "torch.Tensor":
        """The output projection [V, H] beside the embeddings `embed` [V, H] (this rank's rows of
        it where `split_vocab`). As the reference: an lm_head.weight on disk (no prefix) is used
        even when the config `ties` (transformers 5.23.0 unties then); without one, a tied model
        reuses the embeddings and an untied one is refused (the read names the tensor)."""
        if not ties or self.ckpt.has("lm_head.weight"):
            return self.ckpt.load(
                "lm_head.weight", device=self.device, dtype=self.dtype, shape=tuple(embed.shape)
            )
        if not split_vocab:
            return embed
        mine = block(len(embed), self.ckpt.shard.rank, self.ckpt.shard.world)
        return embed[mine.start : mine.stop]  # this rank's vocabulary, a view


def shard_pieces(
    shard: Shard, name: str, shape: Sequence[int]
) -> tuple[int, list[tuple[int, int]]] | None:
    """(dim, ranges along dim) of `shard`'s slice of tensor `name` of `shape` as its shard plan
    cuts it; None: the whole tensor (one rank, no plan, or no cut); (0, []) for another rank's
    expert. ShardRefused names the tensor where the plan's cut does not fit its shape."""
    plan = shard.plan
    if plan is None or shard.world == 1:
        return None
    split, expert = plan.split_of(name)
    try:
        if split.experts:
            if expert is None:
                raise ShardRefused("its pattern has no (?P<expert>...) group")
            if expert not in shard.experts(split.experts):
                return 0, []
        if split.dim is None:
            return None
        if split.dim >= len(shape):
            raise ShardRefused(f"it has no dimension {split.dim}")
        return split.dim, split.pieces(shape[split.dim], shard.rank, shard.world)
    except ShardRefused as e:
        raise ShardRefused(
            f"tensor {name!r} {list(shape)} cannot be cut for --tp {shard.world}: {e}"
        ) from None


def _read_slices(view: Any, ndim: int, dim: int, ranges: list[tuple[int, int]]) -> "torch.Tensor":
    """Read ranges along `dim` of a safetensors slice view, joined in order: only those bytes
    are read from the file."""
    import torch

    parts = []
    for a, b in ranges:
        index = tuple(slice(a, b) if d == dim else slice(None) for d in range(ndim))
        parts.append(view[index])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
