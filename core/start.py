"""Opening a model to serve: settings checked, family chosen, memory planned, weights loaded,
lanes and the engine thread started. Every refusal comes before the weights load."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .checkpoint import Checkpoint
from .engine import Engine
from .family import FamilySpec, ModelShape, resolve
from .kv_plan import GiB, Plan, memory_budget, plan
from .lanes import Lanes
from .logs import get_logger
from .plugins import FamilyError, choose_family, family_plugin_manager, get_plugin_manager
from .profiles import collect_rows
from .settings import Settings, check_environment
from .tokenizer import Tokenizer

log = get_logger("tensorfold.start")

PAGE_ROWS = 512
CPU_ROOM_GIB = 2.0  # the CPU's memory budget when TF_MEMORY_LIMIT_GIB is unset
CUDA_RESERVE = 2 * GiB  # the runtime and fragmentation
ACTIVATION_ROWS = 2048  # a pass's rows, for the activation reserve


@dataclass
class Served:
    """A model ready to serve: what the server and the offline API hold."""

    spec: FamilySpec
    checkpoint: Checkpoint
    tokenizer: Tokenizer
    plan: Plan
    engine: Engine
    model_name: str
    window: int

    def close(self) -> None:
        self.engine.stop()


def pick_device(settings: Settings) -> str:
    if settings.device != "auto":
        return settings.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_dtype(settings: Settings, device: str, config: dict) -> str:
    if settings.dtype != "auto":
        return settings.dtype
    if device == "cpu":
        return "float32"
    stored = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return stored if stored in ("bfloat16", "float16", "float32") else "bfloat16"


def model_folder(spec: FamilySpec, model: str | Path | None, settings: Settings) -> Path:
    if model is not None:
        return Path(model)
    folder = resolve(spec.build_demo)(settings.demo_cache)
    log.info("serving the demo checkpoint", family=spec.name, path=str(folder))
    return Path(folder)


def plan_memory(settings: Settings, shape: ModelShape, device: str, weights: int) -> Plan:
    window = settings.context or shape.max_positions
    if window > shape.max_positions:
        from .kv_plan import PlanRefused

        raise PlanRefused(
            f"--context {window} is past the model's {shape.max_positions} positions",
            need=window,
            have=shape.max_positions,
        )
    layout = shape.layout
    if device == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        # GraphRunner's scratch page and slot (the rows a graph bucket's padding writes) sit
        # outside the pool: counted here with the weights, so the plan's pages stay whole.
        weights += layout.page_bytes(PAGE_ROWS) + layout.fixed_bytes
        activations = ACTIVATION_ROWS * 64 * 1024  # a generous bound per row, until measured
        room = memory_budget(
            device_free=free,
            weights=weights,
            reserve=CUDA_RESERVE,
            activations=activations,
            limit_gib=settings.memory_limit_gib,
        )
    else:
        limit = settings.memory_limit_gib or CPU_ROOM_GIB
        room = memory_budget(
            device_free=None, weights=0, reserve=0, activations=0, limit_gib=limit
        )
    store_on = settings.kv_share > 0
    return plan(
        room=room,
        page_rows=PAGE_ROWS,
        page_bytes=layout.page_bytes(PAGE_ROWS),
        fixed_bytes=layout.fixed_bytes,
        window=window,
        lanes=settings.parallel,
        cache_budget=int(settings.prompt_cache_gib * GiB) if store_on else 0,
        paging=settings.kv_pages,
        snapshot_bytes=settings.kv_share * layout.fixed_bytes,
    )


def open_sharing(settings: Settings, the_plan: Plan, runner, hooks, layout):
    """The prompt store over the pool (TF_KV_SHARE=n states), or None when it is off. Its
    pages are the plan's prompt cache, added to the pool; its snapshot arena is allocated now."""
    from tensorfold.adapters.snapshots import SnapshotArena

    from .prompt_share import PromptSharing

    n = settings.kv_share
    if n < 4 * the_plan.lanes:
        log.warning(
            f"TF_KV_SHARE={n} keeps fewer than 4 states a lane; TF_KV_SHARE={4 * the_plan.lanes} "
            f"would give 4 at --parallel {the_plan.lanes}"
        )
    capacity = n
    if layout.fixed_bytes:
        capacity = min(n, the_plan.snapshot_bytes // layout.fixed_bytes)
    arena = SnapshotArena(layout.fixed, capacity, str(runner.model.device))
    cache_pages = the_plan.cache_bytes // the_plan.page_bytes if the_plan.page_bytes else 0
    log.info(
        f"prompt store: up to {capacity} kept states ({capacity * layout.fixed_bytes} bytes of "
        f"snapshots), {cache_pages} pages of prompts"
    )
    return PromptSharing(
        pool=runner.pool, runner=runner, arena=arena, hooks=hooks, max_states=capacity,
        cache_pages=cache_pages, mark_rows=layout.mark_rows, grid=the_plan.pass_rows,
    )


def open_served(
    settings: Settings, family: str | None = None, model: str | Path | None = None
) -> Served:
    """Check, plan, load and start. Raises SettingsError, FamilyError, CheckpointError or
    PlanRefused (all before any weight loads)."""
    from .runner import ModelRunner

    pm = get_plugin_manager(settings)
    check_environment(settings, collect_rows(pm))
    spec = choose_family(family, pm)
    folder = model_folder(spec, model, settings)
    dummy = settings.load_format == "dummy"
    if dummy and not spec.dummy:
        raise FamilyError(f"family {spec.name!r} has no dummy load format; drop TF_LOAD_FORMAT")
    ckpt = Checkpoint.open(folder, weights=not dummy)
    device = pick_device(settings)
    dtype = pick_dtype(settings, device, ckpt.config)

    def load():
        if dummy:  # random weights in place: nothing to read, and they are already on the device
            return resolve(spec.dummy)(ckpt.config, device, dtype)
        with ckpt.loading():
            return resolve(spec.load)(ckpt, device, dtype)

    if spec.shape and not dummy:
        the_plan = plan_memory(settings, resolve(spec.shape)(ckpt.config, dtype), device,
                               ckpt.total_bytes())
        model_obj = load()
    else:
        model_obj = load()
        the_plan = plan_memory(settings, ModelShape(model_obj.layout, model_obj.max_positions),
                               device, 0)
    log.info(the_plan.startup_line())
    from tensorfold.adapters import paged_kv

    from tensorfold.adapters import snapshots

    hooks = family_plugin_manager(spec, [paged_kv, snapshots])
    store_on = settings.kv_share > 0
    cache_pages = the_plan.cache_bytes // the_plan.page_bytes if store_on and the_plan.page_bytes else 0
    # On CUDA, decode rounds replay a CUDA graph per lane-count bucket (its scratch page and
    # slot are counted in the plan by plan_memory).
    runner_cls = ModelRunner
    if device == "cuda":
        from .cuda_graphs import GraphRunner

        runner_cls = GraphRunner
    runner = runner_cls(
        model_obj,
        num_pages=the_plan.pages + cache_pages,
        num_slots=the_plan.lanes,
        page_rows=PAGE_ROWS,
        poison=settings.kv_poison,
        plugin_manager=hooks,
    )
    sharing = open_sharing(settings, the_plan, runner, hooks.hook, model_obj.layout) if store_on else None
    tokenizer = Tokenizer.from_checkpoint(ckpt)
    lanes = Lanes(
        runner,
        lanes=the_plan.lanes,
        window=the_plan.window,
        tokenizer=tokenizer,
        eos_token_ids=tokenizer.eos_token_ids,
        sharing=sharing,
    )
    engine = Engine(lanes).start()
    name = model if model is not None else f"{spec.name}-demo"
    return Served(spec, ckpt, tokenizer, the_plan, engine, str(name), the_plan.window)
