"""Opening a model to serve: settings checked, family chosen, memory planned, weights loaded,
lanes and the engine thread started. Every refusal comes before the weights load."""

from __future__ import annotations

import dataclasses
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.logs import get_logger
from ..config.settings import Settings, SettingsError, check_environment, torchrun_env
from ..family import FamilySpec, ModelShape, Shard, ShardRefused, resolve
from ..family.checkpoint import Checkpoint, CheckpointError
from ..family.plugins import (
    FamilyError,
    choose_family,
    families,
    family_plugin_manager,
    get_plugin_manager,
    served_by,
)
from ..family.profiles import collect_rows
from ..family.tokenizer import Tokenizer
from ..memory.kv_dtype import kv_label, kv_layout
from ..memory.kv_plan import (
    MIN_STATES_A_LANE,
    GiB,
    Plan,
    PlanRefused,
    fmt_bytes,
    memory_budget,
    plan,
)
from .drafts import DraftSettings
from .engine import Engine
from .lanes import Lanes
from .warm_up import warm_up

log = get_logger("tensorfold.start")

# Refusals every rank reaches alike (rank 0 reports them; the followers exit quietly).
USER_REFUSALS = (SettingsError, FamilyError, CheckpointError, ShardRefused, PlanRefused)

PAGE_ROWS = 512
CPU_ROOM_GIB = 2.0  # the CPU's memory budget when TF_MEMORY_LIMIT_GIB is unset
HOST_SHARE = 0.25  # of the host memory available at start, for the host tier by default
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
    team: Any = None  # tensor parallel: rank 0's side of the ranks (None at one rank)
    tool_format: Any = None  # the family's ToolCallFormat (tool_call_format hook); None: none
    family_note: str = ""  # which family, and why: for the start line
    asked: dict[str, Any] = dataclasses.field(default_factory=dict)  # plan_asked(): for /status
    # TF_SPECIAL_TOKENS_IN_CONTENT: special-token strings in chat content parsed as specials
    content_specials: bool = False
    # the family's ReasoningFormat (reasoning_format hook); None: its replies are content alone
    reasoning_format: Any = None
    # TF_REASONING: the template's `enable_thinking` when a request sets none (None: auto)
    enable_thinking: bool | None = None

    def start_lines(self) -> list[str]:
        """What a start says once: the memory plan and the family chosen."""
        return [self.plan.startup_line(), f"{self.model_name}: {self.family_note}"]

    def close(self) -> None:
        # After a lost rank the engine thread may sit in a collective until its timeout.
        self.engine.stop(timeout=None if self.engine.fatal is None else 10.0)
        if self.team is not None:
            from .tensor_parallel import release_graphs

            release_graphs(self.engine.lanes.runner)
            self.team.close()


@dataclass
class Rank:
    """What every rank opens alike: the checkpoint (its shard), the plan, the model's runner
    over the pool's storage, the family's hooks and the prompt store's snapshot arena."""

    checkpoint: Checkpoint
    plan: Plan
    runner: Any  # ModelRunner or GraphRunner
    hooks: Any  # the family's plugin manager's hook relay
    arena: Any  # SnapshotArena, or None with the prompt store off
    capacity: int  # kept states the store may hold


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


def plan_memory(
    settings: Settings, shape: ModelShape, device: str, weights: int, group: Any = None
) -> Plan:
    """The memory plan for this rank's room (device bytes less `weights` still to load). Under
    tensor parallel every rank plans on the smallest room of all (its own shard's state), so
    the pool is the same everywhere, and a refusal names the rank that is short."""
    room = _room(settings, shape, device, weights)
    if group is None:
        return _plan(settings, shape, room)
    rooms = group.gather(room)
    short = min(range(len(rooms)), key=lambda r: (rooms[r], r))
    try:
        the_plan = _plan(settings, shape, rooms[short])
    except PlanRefused as e:
        raise PlanRefused(
            f"rank {short} of --tp {group.world} is short: {e}", need=e.need, have=e.have
        ) from None
    return dataclasses.replace(the_plan, ranks=group.world)


def _room(settings: Settings, shape: ModelShape, device: str, weights: int) -> int:
    window = settings.context or shape.max_positions
    if window > shape.max_positions:
        raise PlanRefused(
            f"--context {window} is past the model's {shape.max_positions} positions",
            need=window,
            have=shape.max_positions,
        )
    layout = kv_layout(shape.layout, settings.kv_dtype)
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        # GraphRunner's scratch page and slot (the rows a graph bucket's padding writes) and its
        # verify graphs' tap arena (TAP_ROWS rows of the states tapped there) sit outside the
        # pool: counted here with the weights, so the plan's pages stay whole.
        weights += layout.page_bytes(PAGE_ROWS) + layout.fixed_bytes
        if settings.cuda_graphs:
            from .cuda_graphs import TAP_ROWS

            weights += TAP_ROWS * layout.arena_tap_bytes
        activations = ACTIVATION_ROWS * 64 * 1024  # a generous bound per row, until measured
        activations += shape.media_bytes  # a media tower's, at the largest input
        room = memory_budget(
            device_free=free,
            weights=weights,
            reserve=CUDA_RESERVE,
            activations=activations,
            limit_gib=settings.memory_limit_gib,
        )
    else:
        limit = settings.memory_limit_gib or CPU_ROOM_GIB
        room = memory_budget(device_free=None, weights=0, reserve=0, activations=0, limit_gib=limit)
    return room


def _plan(settings: Settings, shape: ModelShape, room: int) -> Plan:
    window = settings.context or shape.max_positions
    layout = kv_layout(shape.layout, settings.kv_dtype)  # the pages' real bytes, scales too
    share = settings.kv_share  # None: on, sized by the plan; 0: off; n: n kept states
    the_plan = plan(
        room=room,
        page_rows=PAGE_ROWS,
        page_bytes=layout.page_bytes(PAGE_ROWS),
        fixed_bytes=layout.fixed_bytes,
        window=window,
        lanes=settings.parallel,
        cache_budget=int(settings.prompt_cache_gib * GiB),
        paging=settings.kv_pages,
        snapshot_bytes=(share or 0) * layout.fixed_bytes,
        states="auto" if share is None else share,
        store=share != 0,
    )
    return dataclasses.replace(the_plan, kv_label=kv_label(layout))


def open_arena(settings: Settings, the_plan: Plan, layout, device: str, arena_cls=None):
    """The prompt store's snapshot arena (the plan's kept states, within its snapshot bytes)
    and its capacity; warns when it keeps fewer than 4 states a lane."""
    from tensorfold.adapters.snapshots import SnapshotArena

    n = the_plan.states
    wanted = MIN_STATES_A_LANE * the_plan.lanes
    if n < wanted:
        said = (
            f"TF_KV_SHARE={settings.kv_share}"
            if settings.kv_share is not None
            else f"the prompt cache ({fmt_bytes(the_plan.cache_bytes + the_plan.snapshot_bytes)})"
        )
        log.warning(
            f"{said} keeps {n} states, fewer than {MIN_STATES_A_LANE} a lane; TF_KV_SHARE="
            f"{wanted} (with a --prompt-cache-gib that funds it) would give {MIN_STATES_A_LANE}"
            f" at --parallel {the_plan.lanes}"
        )
    return (arena_cls or SnapshotArena)(layout.fixed, n, device), n


def open_sharing(the_plan: Plan, runner, hooks, arena, capacity: int, layout, host=None):
    """The prompt store over the pool: its pages are the plan's prompt cache, added to the
    pool; its snapshots live in `arena`; `host` is its host tier (or None)."""
    from ..memory.prompt_share import PromptSharing

    cache_pages = the_plan.cache_bytes // the_plan.page_bytes if the_plan.page_bytes else 0
    log.info(
        f"prompt store: up to {capacity} kept states ({capacity * layout.fixed_bytes} bytes of "
        f"snapshots), {cache_pages} pages of prompts"
    )
    return PromptSharing(
        pool=runner.pool,
        runner=runner,
        arena=arena,
        hooks=hooks,
        max_states=capacity,
        cache_pages=cache_pages,
        mark_rows=layout.mark_rows,
        grid=the_plan.pass_rows,
        host=host,
    )


def open_host_tier(settings: Settings, the_plan: Plan, runner, arena, layout):
    """The prompt store's host tier (TF_KV_HOST_GIB, by default HOST_SHARE of the host memory
    available now), or None when it is off or funds not even one state. Its bytes go first to
    snapshot slots (sized as the device store's kept states are, from the same bytes), the rest
    to pages."""
    from ..memory.host_tier import HostTier, available_host_memory, host_budget
    from ..memory.kv_plan import auto_states

    budget = host_budget(settings.kv_host_gib, HOST_SHARE, available_host_memory())
    page_bytes, fixed = the_plan.page_bytes, layout.fixed_bytes
    slots = auto_states(budget, fixed_bytes=fixed, page_bytes=page_bytes, lanes=the_plan.lanes)
    pages = (budget - slots * fixed) // page_bytes if page_bytes else 0
    if budget <= 0 or pages < 1 or (fixed and slots < 1):
        log.info(
            "prompt store host tier off"
            + (f" ({fmt_bytes(budget)} funds no state)" if budget > 0 else "")
        )
        return None
    tier = HostTier(
        runner.rows, arena, pages, slots, str(runner.model.device), poison=settings.kv_poison
    )
    log.info(
        f"prompt store host tier: {fmt_bytes(tier.bytes)} of host memory, {pages} pages "
        f"and {tier.num_slots} snapshot slots"
    )
    return tier


def open_rank(
    settings: Settings, spec: FamilySpec, folder: Path, group: Any = None, arena_cls: Any = None
) -> Rank:
    """Open the checkpoint (this rank's shard of it under tensor parallel), plan, load and
    build the runner and the snapshot arena. Refusals (FamilyError, CheckpointError,
    ShardRefused, PlanRefused) come before any weight loads."""
    from tensorfold.adapters import paged_kv, snapshots

    from .runner import ModelRunner

    dummy = settings.load_format == "dummy"
    if dummy and not spec.dummy:
        raise FamilyError(f"family {spec.name!r} has no dummy load format; drop TF_LOAD_FORMAT")
    ckpt = Checkpoint.open(folder, weights=not dummy)
    quantize_dummy = dummy and settings.quantization == "fp8"
    if quantize_dummy and "quantization" not in inspect.signature(resolve(spec.dummy)).parameters:
        raise FamilyError(
            f"family {spec.name!r} ({spec.distribution}): its dummy weights take no "
            "quantization; drop TF_LOAD_FORMAT=dummy or --quantization fp8"
        )
    if settings.quantization == "fp8":
        if not spec.fp8_linears:
            raise FamilyError(
                f"family {spec.name!r} ({spec.distribution}) declares no fp8 linears "
                "(FamilySpec.fp8_linears); drop --quantization fp8"
            )
    ckpt.set_quantization(spec.fp8_linears, at_load=settings.quantization == "fp8")
    device = pick_device(settings) if group is None else group.device(pick_device(settings))
    dtype = pick_dtype(settings, device, ckpt.config)
    hooks = family_plugin_manager(spec, [paged_kv, snapshots])
    if settings.draft == "mtp":  # its layer's weights and state in the plan and the load
        ckpt.config = mtp_config(settings, spec, hooks.hook, ckpt, tp=group is not None)
    layout = None
    if group is not None:
        shards = hooks.hook.shard_plan(config=ckpt.config, dtype=dtype, world=group.world)
        if shards is None:
            raise no_shard_plan(spec)
        ckpt.set_shard(Shard(group.rank, group.world, shards))
        layout = shards.layout

    def load():
        if dummy:  # random weights in place: nothing to read, and they are already on the device
            fp8 = {"quantization": "fp8"} if quantize_dummy else {}
            return resolve(spec.dummy)(ckpt.config, device, dtype, **fp8)
        with ckpt.loading(progress=None if group is None or group.rank == 0 else False):
            return resolve(spec.load)(ckpt, device, dtype)

    if spec.shape and not dummy:
        shape = resolve(spec.shape)(ckpt.config, dtype)
        if layout is not None:
            shape = dataclasses.replace(shape, layout=layout)
        weight_bytes = ckpt.local_bytes()
        the_plan = plan_memory(settings, shape, device, weight_bytes, group)
        fp8 = ckpt.fp8 is not None or ckpt.quantize_at_load
        the_plan = dataclasses.replace(
            the_plan, weight_bytes=weight_bytes, weight_label="fp8 linears" if fp8 else ""
        )
        model_obj = load()
    else:
        model_obj = load()
        the_plan = plan_memory(
            settings, ModelShape(model_obj.layout, model_obj.max_positions), device, 0, group
        )
    if layout is not None and model_obj.layout != layout:
        raise FamilyError(
            f"family {spec.name!r}: the loaded shard's state layout differs from "
            "the one its shard_plan declared"
        )
    cache_pages = the_plan.cache_bytes // the_plan.page_bytes if the_plan.page_bytes else 0
    # On CUDA, decode rounds replay a CUDA graph per lane-count bucket (its scratch page and
    # slot are counted in the plan by plan_memory).
    runner_cls, graph_args = ModelRunner, {}
    from ..ops import gpu

    gpu.set_dependent_launch(settings.dependent_launch)
    gpu.set_prefetch_weights(settings.prefetch_weights)
    if device.startswith("cuda") and settings.cuda_graphs:
        from .cuda_graphs import GraphRunner

        # A graph's page tables are a window wide, not the pool's width: kernels that size
        # their work by the table (glm's pool scores) then do a window's work at most.
        runner_cls, graph_args = GraphRunner, {"max_pages": -(-the_plan.window // PAGE_ROWS) + 1}
    runner = runner_cls(
        model_obj,
        num_pages=the_plan.pages + cache_pages,
        num_slots=the_plan.lanes,
        page_rows=PAGE_ROWS,
        poison=settings.kv_poison,
        plugin_manager=hooks,
        kv_dtype=settings.kv_dtype,
        **graph_args,
    )
    arena, capacity = None, 0
    if the_plan.store_on:
        arena, capacity = open_arena(
            settings, the_plan, runner.layout, str(model_obj.device), arena_cls
        )
    return Rank(ckpt, the_plan, runner, hooks.hook, arena, capacity)


def no_shard_plan(spec: FamilySpec) -> FamilyError:
    return FamilyError(
        f"family {spec.name!r} ({spec.distribution}) declares no tensor "
        f"parallel (no shard_plan hook answers); drop --tp"
    )


def refuse_unshardable(settings: Settings, spec: FamilySpec, folder: Path, world: int) -> None:
    """--tp N's refusals that need no other rank, from config.json alone, before any follower
    starts: a family that declares no tensor parallel (FamilyError), a config its shard_plan
    cannot cut (ShardRefused)."""
    from tensorfold.adapters import paged_kv, snapshots

    config = Checkpoint.open(folder, weights=False).config
    hooks = family_plugin_manager(spec, [paged_kv, snapshots])
    dtype = pick_dtype(settings, pick_device(settings), config)
    if hooks.hook.shard_plan(config=config, dtype=dtype, world=world) is None:
        raise no_shard_plan(spec)


def open_served(
    settings: Settings, family: str | None = None, model: str | Path | None = None
) -> Served:
    """Check, plan, load and start. Raises SettingsError, FamilyError, CheckpointError,
    ShardRefused or PlanRefused (all before any weight loads). Under tensor parallel
    (settings.tp > 1, or a torchrun launch) this is rank 0, which starts the other ranks; under
    torchrun the other ranks follow rank 0 here and exit when it stops (SystemExit)."""
    pm = get_plugin_manager(settings)
    check_environment(settings, collect_rows(pm))
    asked = family or settings.family
    config = folder_config(model) if asked is None and model is not None else None
    spec = choose_family(asked, pm, config)
    launch = parallel_launch(settings)
    if launch is not None and launch.rank > 0:
        from .tensor_parallel import follow

        folder = model_folder(spec, model, settings)
        raise SystemExit(
            follow(settings, spec, folder, launch, open_rank=open_rank, refusals=USER_REFUSALS)
        )
    folder = model_folder(spec, model, settings)
    team = None
    if launch is not None:
        from .tensor_parallel import Team

        if launch.spawned:
            refuse_unshardable(settings, spec, folder, launch.world)
        team = Team.start(settings, spec, folder, launch)
    try:
        rank = open_rank(settings, spec, folder, team.joined if team else None)
        runner: Any = rank.runner if team is None else team.lead(rank)  # a Leader stands in
        layout = rank.runner.layout  # as stored: fp8 state and its scales under --kv-dtype fp8
        sharing = None
        if rank.arena is not None:
            # Under tensor parallel each rank's state is its shard: the host tier, which copies
            # one runner's pages, is for one rank only.
            host = (
                None
                if team is not None
                else open_host_tier(settings, rank.plan, rank.runner, rank.arena, layout)
            )
            sharing = open_sharing(
                rank.plan, runner, rank.hooks, rank.arena, rank.capacity, layout, host
            )
        tokenizer = Tokenizer.from_checkpoint(rank.checkpoint)
        lanes = Lanes(
            runner,
            lanes=rank.plan.lanes,
            window=rank.plan.window,
            tokenizer=tokenizer,
            eos_token_ids=tokenizer.eos_token_ids,
            sharing=sharing,
            hooks=rank.hooks,
            drafts=DraftSettings(settings.draft, settings.draft_tokens),
            model_drafter=open_drafter(settings, spec, rank, runner, team is not None),
        )
        device = str(rank.runner.model.device)
        if settings.warm_up if settings.warm_up is not None else device.startswith("cuda"):
            warm_up(lanes, rank.runner.model.vocab_size)
        engine = Engine(lanes)
        if team is not None:
            team.on_fatal = engine.die
        engine.start()
    except BaseException as exc:
        if team is not None:
            lost = team.abort()
            if lost is not None and not isinstance(exc, USER_REFUSALS):
                from .tensor_parallel import TensorParallelError

                raise TensorParallelError(lost) from exc  # names the follower that exited
        raise
    name = model if model is not None else f"{spec.name}-demo"
    tool_format = rank.hooks.tool_call_format(config=rank.checkpoint.config)
    reasoning_format = rank.hooks.reasoning_format(config=rank.checkpoint.config)
    return Served(
        spec,
        rank.checkpoint,
        tokenizer,
        rank.plan,
        engine,
        str(name),
        rank.plan.window,
        team,
        tool_format,
        family_note(spec, asked, pm, config),
        plan_asked(settings),
        content_specials=settings.special_tokens_in_content,
        reasoning_format=reasoning_format,
        enable_thinking={"on": True, "off": False}.get(settings.reasoning),
    )


# what a start refused --draft mtp may use instead
DRAFTS_ACCEPTED = "use --draft ngram, or --draft model --draft-model DIR with a draft checkpoint"


def mtp_config(
    settings: Settings, spec: FamilySpec, hooks: Any, ckpt: Checkpoint, tp: bool
) -> dict:
    """--draft mtp: the config the family loads its checkpoint with, its MTP layer in (the
    mtp_config hook); a start that cannot draft with one is refused naming why, before any
    weight loads."""
    if settings.draft_model is not None:
        raise SettingsError(
            "TF_DRAFT_MODEL / --draft-model is set but TF_DRAFT is 'mtp', which drafts with the "
            "checkpoint's own MTP layer: use --draft model to draft with the folder"
        )
    if tp:
        raise SettingsError("--draft mtp runs at one rank only for now; leave out --tp")
    try:
        config = hooks.mtp_config(checkpoint=ckpt)
    except CheckpointError as e:
        raise SettingsError(f"--draft mtp: {e}; {DRAFTS_ACCEPTED}") from None
    if config is None:
        raise SettingsError(
            f"--draft mtp: the {spec.name} family has no MTP layer to draft with (its plugin "
            f"answers no mtp_config hook); {DRAFTS_ACCEPTED}"
        )
    return dict(config)


def open_drafter(settings: Settings, spec: FamilySpec, rank: Any, runner: Any, tp: bool) -> Any:
    """The family's drafter for --draft model (a draft checkpoint) or --draft mtp (the
    checkpoint's own MTP layer, loaded as `mtp_config` said), through the model_drafter hook;
    else None. A start that asks for one it cannot have is refused naming why."""
    if settings.draft == "mtp":
        drafter = rank.hooks.model_drafter(model=rank.runner.model, runner=runner, folder=None)
        if drafter is None:
            raise SettingsError(
                f"--draft mtp: the {spec.name} family answers no model_drafter hook for its "
                f"MTP layer; {DRAFTS_ACCEPTED}"
            )
        log.info("drafting with the checkpoint's own MTP layer")
        return drafter
    if settings.draft != "model":
        if settings.draft_model is not None:
            raise SettingsError(
                f"TF_DRAFT_MODEL / --draft-model is set but TF_DRAFT is {settings.draft!r}: "
                "use --draft model to draft with it"
            )
        return None
    if settings.draft_model is None:
        raise SettingsError("--draft model needs the draft checkpoint: --draft-model DIR")
    if tp:
        raise SettingsError("--draft model runs at one rank only for now; leave out --tp")
    drafter = rank.hooks.model_drafter(
        model=rank.runner.model, runner=runner, folder=Path(settings.draft_model)
    )
    if drafter is None:
        raise SettingsError(
            f"the {spec.name} family has no draft model (its plugin answers no model_drafter "
            "hook); use --draft ngram or off"
        )
    log.info(f"drafting with the draft model at {settings.draft_model}")
    return drafter


def plan_asked(settings: Settings) -> dict[str, Any]:
    """What the memory plan was asked for (None: the default), to show beside what it gave."""
    return {
        "parallel": settings.parallel,
        "context": settings.context,
        "prompt_cache_gib": settings.prompt_cache_gib,
        "kv_pages": settings.paging,
        "kv_share": settings.kv_share,
        "memory_limit_gib": settings.memory_limit_gib,
    }


def folder_config(model: str | Path) -> dict | None:
    """A --model folder's config.json as a dict, to choose its family by; None where it has
    none that parses (the checkpoint's own opening then says why)."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def family_note(spec: FamilySpec, asked: str | None, pm: Any, config: dict | None = None) -> str:
    """'family NAME', and when it was chosen by the --model folder's config.json, by what; when
    it was chosen by default among several, the others and how to pick one of them."""
    if asked is not None:
        return f"family {spec.name}"
    if config is not None and spec.serves_config(config):
        return f"family {spec.name}, which serves the checkpoint's {served_by(config)}"
    others = [name for name in families(pm) if name != spec.name]
    if not others:
        return f"family {spec.name}"
    return (
        f"family {spec.name}, the default (also installed: {', '.join(others)}; "
        "--family or TF_FAMILY picks one)"
    )


def parallel_launch(settings: Settings):
    """How this process takes part in tensor parallel: None at one rank; rank 0 of
    settings.tp that starts the others; or the rank torchrun's variables name."""
    env = torchrun_env()
    if env is not None and env.world > 1:
        if settings.tp not in (1, env.world):
            raise SettingsError(
                f"--tp {settings.tp} disagrees with torchrun's WORLD_SIZE="
                f"{env.world}; drop --tp under torchrun"
            )
        from .tensor_parallel import Launch

        return Launch(
            env.rank, env.world, env.local_rank, env.master_addr, env.master_port, spawned=False
        )
    if settings.tp == 1:
        return None
    from .tensor_parallel import Launch

    return Launch(0, settings.tp, 0, "127.0.0.1", 0, spawned=True)
