"""What the status page shows of the engine: one summary of the pool, the lanes and the prompt
store, taken on the engine thread between two rounds and only when a watcher asked for it
(Engine.ask_summary). The summary is plain data built fresh each time (numbers, strings, lists,
dicts), so the server can serialize it on its own thread while the engine goes on.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..memory.prompt_radix import Node
    from .lanes import Lanes, Live
    from .requests import Request

MAX_WAITING = 32  # waiting requests listed (all are counted)
MAX_NODES = 200  # prompt-store tree nodes sent; the rest are counted


def take_summary(lanes: Lanes, inbox: int = 0) -> dict[str, Any]:
    """The engine's state now. `inbox`: requests submitted and not yet seen by the lanes."""
    now = time.monotonic()
    census = lanes.pool.census()
    runner = lanes.runner
    return {
        "pool": {
            "free": census.free,
            "promised": census.promised,
            "live": census.live,
            "shared": census.shared,
            "store": census.store,
            "total": census.total,
            "host": None
            if census.host is None
            else dict(zip(("free", "store", "total"), census.host)),
            "idle": lanes.idle,
            "even": census.idle_even,
            "census": census.line(),
        },
        "lanes": {
            "total": lanes.num_lanes,
            "busy": lanes.num_lanes - len(lanes.free_slots),
            "pages": len({p for s in lanes.live for p in s.lease.pages}),  # the pool's live
            "streams": [_stream(s, lanes.pass_rows, now) for s in list(lanes.live)],
        },
        "waiting": {
            "count": len(lanes.waiting) + inbox,
            "requests": [_waiting(r, now) for r in list(lanes.waiting)[:MAX_WAITING]],
        },
        "store": _store(lanes, now),
        "engine": {
            "passes": lanes.passes,
            "rows_cached": lanes.rows_cached,
            "rows_computed": lanes.rows_computed,
            "tokens_out": lanes.tokens_out,
            "tokens_drafted": lanes.tokens_drafted,
            "drafts_accepted": lanes.drafts_accepted,
            "verify_rounds": lanes.verify_rounds,
            "uneven": lanes.uneven,
            "graph_replays": getattr(runner, "replays", 0),
        },
    }


def _stream(s: Live, pass_rows: int, now: float) -> dict[str, Any]:
    prompt = len(s.req.prompt)
    out: dict[str, Any] = {
        "id": s.req.id,
        "slot": s.slot,
        "prompt": prompt,
        "cached": s.cached,
        "pos": s.pos,
        "generated": len(s.generated),
        "max_tokens": s.req.params.max_tokens,
        "pages": len(s.lease.pages),
        "promised": s.lease.promised,
        "age_s": round(now - s.req.arrival, 3),
        "choices": 1 + len(s.forks),
    }
    if s.drafts is not None:
        out["drafted"], out["accepted"] = s.drafts.drafted, s.drafts.accepted
    if s.prefilling:
        first = s.cached // pass_rows  # passes are cut on the absolute grid
        out["phase"] = "prefill"
        out["pass"] = s.pos // pass_rows - first + 1
        out["passes"] = -(-prompt // pass_rows) - first
    else:
        out["phase"] = "decode"
    return out


def _waiting(r: Request, now: float) -> dict[str, Any]:
    return {
        "id": r.id,
        "prompt": len(r.prompt),
        "max_tokens": r.params.max_tokens,
        "age_s": round(now - r.arrival, 3),
        "choices": 1 + len(r.forks),
    }


def _store(lanes: Lanes, now: float) -> dict[str, Any] | None:
    sharing = lanes.sharing
    if sharing is None:
        return None
    budget = {"left": MAX_NODES, "left_out": 0}
    trees = [_node(root, now, budget) for root in sharing.store.roots()]
    return {
        "states": len(sharing.store),
        "on_device": sharing.device_states,
        "max_states": sharing.max_states,
        "pages": lanes.pool.store_pages,
        "max_pages": sharing.cache_pages,
        "evictions": sharing.evictions,
        "on_host": sharing.on_host,
        "host_hits": sharing.host_hits,
        "host_evictions": sharing.host_evictions,
        "tree": [t for t in trees if t is not None],
        "nodes_left_out": budget["left_out"],
    }


def _node(node: Node, now: float, budget: dict[str, int]) -> dict[str, Any] | None:
    """The subtree under `node`, depth first, while the node budget lasts; past it, nodes are
    only counted."""
    if budget["left"] <= 0:
        budget["left_out"] += 1 + sum(1 for _ in _descendants(node))
        return None
    budget["left"] -= 1
    out: dict[str, Any] = {"tokens": len(node.edge), "depth": node.depth}
    kept = node.kept
    if kept is not None:
        out["kept"] = {
            "pages": len(kept.pages) if kept.host is None else len(kept.host.pages),
            "snapshot": kept.snapshot is not None or kept.host is not None,
            "hits": kept.hits,
            "host": kept.host is not None,
            "idle_s": round(now - kept.used_at, 3),
        }
    children = [_node(c, now, budget) for c in list(node.children.values())]
    out["children"] = [c for c in children if c is not None]
    return out


def _descendants(node: Node):
    stack = list(node.children.values())
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children.values())
