"""The plugin contract: every hook a tensorfold plugin may implement, documented here.

Plugins implement them with ``@tensorfold.hookimpl``. Collection hooks (``register_families``,
``profile_rows``) are called on the plugin manager of all installed plugins. Per-family hooks
(``share_pool``, ``share_attach``, ``snap_keep``, ``snap_restore``, ``shard_plan``,
``tool_call_format``, ``reasoning_format``, ``mtp_config``, ``model_drafter``,
``media_processor``) are called on
the chosen family's own plugin manager (``tensorfold.family.plugins.family_plugin_manager``), which
holds the core adapters' default implementations and the family's ``FamilySpec.hooks`` object;
the family's implementation is called first, so it overrides a default by answering.

docs/hooks.md repeats each signature; tests/test_docs.py keeps the two in step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from pathlib import Path

    from tensorfold.adapters.paged_kv import PagedRows
    from tensorfold.adapters.snapshots import Snapshot, SnapshotArena
    from tensorfold.adapters.stream_state import StreamSlots
    from tensorfold.family import FamilySpec, ShardPlan, StateLayout
    from tensorfold.family.checkpoint import Checkpoint
    from tensorfold.family.media import MediaProcessor
    from tensorfold.family.profiles import ProfileRow
    from tensorfold.family.reasoning import ReasoningFormat
    from tensorfold.family.tool_calls import ToolCallFormat
    from tensorfold.memory.kv_pool import Lease

hookspec = pluggy.HookspecMarker("tensorfold")
# what plugins mark their implementations with; `tensorfold.hookimpl` is this marker
hookimpl = pluggy.HookimplMarker("tensorfold")


@hookspec
def register_families(register: Callable[[FamilySpec], None]) -> None:
    """Register the model families this plugin provides.

    Call ``register(spec)`` once per family with a ``tensorfold.family.FamilySpec``. Keep this
    cheap: ``load``, ``build_demo`` and ``hooks`` are "module:attr" strings imported only once
    the family is chosen. The core fills in the spec's distribution and version, refuses a
    family name registered twice, and answers an unknown ``--family`` with the installed names.

    :param register: call with each ``FamilySpec``.
    """


@hookspec
def profile_rows(register: Callable[[ProfileRow], None]) -> None:
    """Register the plugin's settings rows for ``tensorfold profiles`` and docs/profiles.md.

    Call ``register(row)`` with a ``tensorfold.family.profiles.ProfileRow`` for every TF_* variable the
    plugin reads (through ``Settings.plugin_value``), and for every retired one, with
    ``replaced_by`` naming its replacement: a retired variable set to anything but "" or "0"
    refuses the start before the weights load. The core refuses a setting registered twice with
    different text.

    :param register: call with each ``ProfileRow``.
    """


@hookspec(firstresult=True)
def share_pool(
    layout: StateLayout, num_pages: int, page_rows: int, device: str
) -> PagedRows | None:
    """Map the family's paged rows onto the pool's pages.

    Called once at start, after the memory plan, on the chosen family's plugin manager.
    The core adapter (``tensorfold.adapters.paged_kv``) answers for the common case, one
    buffer per ``RowSpec`` of ``layout.paged``; a family answers itself only when its rows
    need another mapping.

    :param layout: the family's state layout; ``layout.paged`` lists the per-token rows.
    :param num_pages: how many pages the pool holds; page ids are ``0 .. num_pages - 1``.
    :param page_rows: rows (tokens) per page.
    :param device: the torch device the buffers live on, e.g. "cuda:0" or "cpu".
    :return: the storage holding each paged buffer's rows, indexed by pool page id.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def share_attach(
    lease: Lease, rows: PagedRows, kept_pages: list[int], kept_rows: int
) -> list[int] | None:
    """Build the page table a resumed stream starts with, from pages the prompt store kept.

    Full kept pages are shared by reference (``lease.attach``: the pool counts the extra
    holder); a partial last page is copied into a page of the stream's own, taken from the
    lease's promise, because the stream will write its next rows there. It also builds a
    forked choice's table (n > 1): the first choice's prompt pages, ``kept_rows`` the prompt's
    length; the fork's fixed state is its slot copied whole, so per-stream state that is not
    paged lives in slots.

    :param lease: the resumed stream's lease (its ``pool``, its promise, its page table).
    :param rows: the storage ``share_pool`` returned.
    :param kept_pages: the store's page ids holding the kept prefix, in order.
    :param kept_rows: how many rows of the prefix are kept; the last page holds
        ``kept_rows - (len(kept_pages) - 1) * page_rows`` of them.
    :return: the stream's page table: page ids, one per ``page_rows`` rows of the prefix.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def snap_keep(
    slots: StreamSlots, slot: int, arena: SnapshotArena, taps: Mapping[str, Any] | None
) -> Snapshot | None:
    """Keep a stream's fixed (not paged) state at a mark, in leased snapshot pages.

    The core adapter (``tensorfold.adapters.snapshots``) leases pages from ``arena`` and copies
    each of the slot's fixed buffers into them: no allocation per keep.

    :param slots: the per-stream fixed-state buffers of every lane.
    :param slot: the stream's slot in ``slots``.
    :param arena: the snapshot arena to lease pages from.
    :param taps: state tapped mid-pass where the pass computed the mark, by buffer name (these
        win over the slot's current contents, which are already past the mark); None when the
        mark is where the slot's state stands now.
    :return: the snapshot, or None when none can be kept (the arena has no free pages).

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def snap_restore(
    snapshot: Snapshot, arena: SnapshotArena, slots: StreamSlots, slot: int
) -> bool | None:
    """Copy a kept snapshot back into a stream's slot, before the stream prefills the rest.

    The snapshot stays leased (the store still holds it); the copy is the stream's own.

    :param snapshot: the snapshot ``snap_keep`` returned.
    :param arena: the arena holding the snapshot's pages.
    :param slots: the per-stream fixed-state buffers of every lane.
    :param slot: the stream's slot in ``slots``.
    :return: True when restored; False when this snapshot cannot be restored here (the stream
        then prefills from the start).

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def shard_plan(config: Mapping[str, Any], dtype: str, world: int) -> ShardPlan | None:
    """Say how the family's weights and state split across ``world`` tensor-parallel ranks.

    Called before any weight loads, on every rank, when the server starts with ``--tp N`` (or
    under torchrun), on the chosen family's plugin manager. No answer: the family has no tensor
    parallel, and ``--tp`` above 1 is refused naming it. Each rank then loads only its slice of
    every tensor (``Checkpoint.load`` cuts it with safetensors' ``get_slice``), and its forward
    combines partial results with ``tensorfold.ops.parallel`` (``sum_partials`` after a
    row-parallel linear or the local experts, ``gather_columns`` after a vocab-parallel
    lm_head), which are the identity at one rank.

    Column-parallel weights (q/k/v, gate/up, in_proj) are ``Split(dim=0)``, by heads with
    ``parts``; row-parallel ones (o, down, out_proj) ``Split(dim=1)``; KV heads fewer than
    ranks are replicated (``parts`` below ``world``); a MoE's experts go whole to one rank
    each (``Split(experts=E)``) with the router replicated; embeddings and norms stay whole.

    :param config: config.json as a dict.
    :param dtype: the dtype the weights load in, e.g. "bfloat16".
    :param world: how many ranks (2 or more).
    :return: a ``tensorfold.family.ShardPlan``: the splits by on-disk name, and one rank's state
        layout; raise ``tensorfold.family.ShardRefused`` when the config cannot be cut for
        ``world`` ranks (say which dimension).

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def tool_call_format(config: Mapping[str, Any]) -> ToolCallFormat | None:
    """Describe the family's tool-call markup, so the server can turn it into OpenAI tool calls.

    Called once at start, on the chosen family's plugin manager. The answer is a
    ``tensorfold.family.tool_calls.ToolCallFormat``: the markers that open and close a call section
    (as the family's chat template writes an assistant's ``tool_calls``), a function parsing the
    text between them into (name, arguments) pairs, raising
    ``tensorfold.family.tool_calls.MalformedToolCall`` when it does not parse, and the markers the
    model writes after its calls. The core finds the sections in the generated text, streamed or
    whole, and never guesses a format. No answer: the family has no tool calls, and a request
    that offers tools is refused naming the family.

    :param config: config.json as a dict (a family whose checkpoints differ in format picks by
        it).
    :return: the family's ``ToolCallFormat``.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def reasoning_format(config: Mapping[str, Any]) -> ReasoningFormat | None:
    """Describe the family's thinking markup, so the server can split a reply's reasoning out.

    Called once at start, on the chosen family's plugin manager. The answer is a
    ``tensorfold.family.reasoning.ReasoningFormat``: the markers that open and close a thinking
    block, as the family's chat template writes them (``<think>`` / ``</think>``). The core
    splits generated text, streamed or whole, into ``reasoning_content`` and ``content``
    (``tensorfold.family.reasoning.ReasoningStream``): a reply starts inside thinking when its
    rendered prompt's last start marker comes after its last end marker, and a start marker in
    the reply opens a block too. Markers that are special tokens are kept in the decoded text.
    No answer: the family does not think, and its replies are content alone.

    :param config: config.json as a dict (a family whose checkpoints differ in markup picks by
        it).
    :return: the family's ``ReasoningFormat``.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def mtp_config(checkpoint: Checkpoint) -> dict[str, Any] | None:
    """config.json as the family loads it to serve the checkpoint's own multi-token-prediction
    layer (`--draft mtp`), so that its weights load and its state is in the memory plan.

    Called once at start with `--draft mtp`, before the memory plan and before any weight
    loads, on the chosen family's plugin manager; the core then serves the checkpoint with the
    answer in place of its config.json (``Checkpoint.config``: the plan's ``shape`` and the
    ``load`` read it), and asks ``model_drafter`` with ``folder=None`` for the drafter. Raise
    ``tensorfold.family.checkpoint.CheckpointError`` naming what is missing when this
    checkpoint has no such layer (config.json declares none, or its weights are not in the
    files); the start is refused with it. No answer: the family has no MTP layer, and `--draft
    mtp` is refused naming the family.

    :param checkpoint: the checkpoint opened (its ``config``, its tensor names; no weight read).
    :return: the config dict to load with.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def model_drafter(model: Any, runner: Any, folder: Path | None) -> Any:
    """The family's own drafter: for `--draft model --draft-model DIR` a draft checkpoint at
    `folder`, for `--draft mtp` (`folder` None) the target checkpoint's own MTP layer (loaded
    as ``mtp_config`` said); it proposes each drafting stream's next tokens from what the
    target computed.

    Called once at start, after the target loaded, on the chosen family's plugin manager. The
    answer is a ``tensorfold.family.drafter.ModelDrafter``: ``propose(asks, k)`` gets, once a
    round, a ``DraftAsk`` a drafting stream (its slot, page table, position, next token and the
    last pass's logit row it was drawn from) and returns up to k tokens each, reading the
    target's storage (``runner.rows``, ``runner.slots``) and its model's last pass. It may
    write only rows at or past the ask's position (the next pass rewrites those it keeps) and
    must leave every slot's fixed state as it found it. Drafts change no token: the lanes
    verify them. Refuse a checkpoint that does not fit the target with
    ``tensorfold.family.checkpoint.CheckpointError`` naming what.
    No answer: the family has no drafter of that kind (a draft model for a folder, an MTP
    layer for None), and the start is refused naming it.

    :param model: the target (the family's ``FamilyModel``).
    :param runner: the engine's runner (its ``rows``, ``slots``, ``pool``).
    :param folder: the draft checkpoint's folder; None: the target's own MTP layer.
    :return: a ``ModelDrafter``.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def media_processor(folder: Path | None, config: Mapping[str, Any]) -> MediaProcessor | None:
    """How the family prepares images and audio (later video) for its towers, from the checkpoint.

    Called where prompts are prepared (the server's prompt workers, ``tensorfold generate``),
    on the chosen family's plugin manager, with the checkpoint's folder (its
    ``preprocessor_config.json`` / ``processor_config.json``; None for a demo or dummy model)
    and its config.json. The answer is a ``tensorfold.family.media.MediaProcessor``: the kinds
    it takes, the placeholder the chat template writes for an image (and its one token id),
    whether an image's rows form a bidirectional block, ``prepare_image(image)`` (the inputs
    ``FamilyModel.encode_media`` reads, and how many rows the image fills) and
    ``image_ids(rows)`` (the ids that replace the placeholder); with "audio" in its kinds also
    a ``tensorfold.family.media.AudioProcessor`` (``prepare_audio(samples, rate)``,
    ``audio_ids(rows)``, the audio placeholder and its token). Keep it torch-light: it runs
    once per worker. No answer: the family takes no media, and a request with an image is
    refused with a 400 naming the family.

    :param folder: the checkpoint's folder, or None.
    :param config: config.json as a dict (a checkpoint without ``vision_config`` answers None).
    :return: a ``MediaProcessor``, or None.

    Stops at first non-None result.
    """
