"""The prompt store: kept prompt states in a radix tree over token ids.

A kept state at position m holds the pool pages with rows [0, m) (references shared with the
streams that wrote or attached them) and, for state that is not paged, a snapshot taken after
row m - 1. Lookup finds the longest kept state whose tokens are a prefix of a new prompt.
Torch-free: what holding and dropping a state means is the caller's (`on_drop`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence


@dataclass(eq=False)
class Kept:
    pos: int  # rows [0, pos) are in `pages`; `snapshot` is the state after row pos - 1
    pages: list[int]
    snapshot: Any
    node: "Node"
    last_used: int = 0
    host: Any = None  # set while the state lives in the host tier (pages and snapshot moved)
    hits: int = 0  # resumes from this state
    used_at: float = 0.0  # time.monotonic() of its keep or its last resume


@dataclass(eq=False)
class Node:
    edge: tuple[int, ...]  # the tokens from the parent to this node
    depth: int  # tokens from the root to this node's end
    parent: "Node | None" = None
    children: dict[int, "Node"] = field(default_factory=dict)
    kept: Kept | None = None


class RadixStore:
    """Longest-prefix lookup of kept states; least-recently-used eviction.

    The caller keeps the limits: `len(store)` states, and whatever its pages cost (it evicts
    with `evict_lru()` until it is within them). `key` is a content key for non-text inputs
    (an image's hash): states under different keys never match each other.
    """

    def __init__(self, on_drop: Callable[[Kept], None]):
        self._roots: dict[Any, Node] = {}
        self._on_drop = on_drop
        self._clock = itertools.count(1)
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def roots(self) -> list[Node]:
        """The trees' roots, one a content key (for the status page's walk)."""
        return list(self._roots.values())

    def kept(self) -> Iterator[Kept]:
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.kept is not None:
                yield node.kept
            stack.extend(node.children.values())

    def lookup(self, tokens: Sequence[int], limit: int, key: Any = None) -> Kept | None:
        """The deepest kept state whose tokens prefix `tokens`, at a position <= limit."""
        node = self._roots.get(key)
        best = None
        at = 0
        while node is not None:
            if node.kept is not None and node.depth <= limit:
                best = node.kept
            if at >= len(tokens) or node.depth >= limit:
                break
            child = node.children.get(tokens[at])
            if child is None or tuple(tokens[at : at + len(child.edge)]) != child.edge:
                break
            at += len(child.edge)
            node = child
        if best is not None:
            best.last_used = next(self._clock)
        return best

    def has(self, tokens: Sequence[int], key: Any = None) -> Kept | None:
        """The state kept at exactly `tokens`, if any (touching it)."""
        node = self._find(tokens, key)
        if node is not None and node.kept is not None:
            node.kept.last_used = next(self._clock)
            return node.kept
        return None

    def insert(
        self, tokens: Sequence[int], pages: list[int], snapshot: Any, key: Any = None
    ) -> Kept:
        """Keep a state at len(tokens); the store now owns `pages` and `snapshot`."""
        node = self._make_path(tuple(tokens), key)
        if node.kept is not None:
            raise ValueError(f"a state is already kept at position {node.depth}")
        node.kept = Kept(len(tokens), pages, snapshot, node, next(self._clock))
        self._count += 1
        return node.kept

    def evict_lru(self) -> Kept | None:
        """Drop the least recently used state; None when the store is empty."""
        oldest = min(self.kept(), key=lambda k: k.last_used, default=None)
        if oldest is not None:
            self.drop(oldest)
        return oldest

    def drop(self, kept: Kept) -> None:
        node = kept.node
        node.kept = None
        self._count -= 1
        self._on_drop(kept)
        while node.parent is not None and node.kept is None and not node.children:
            del node.parent.children[node.edge[0]]
            node = node.parent

    def clear(self) -> None:
        for kept in list(self.kept()):
            self.drop(kept)

    def _find(self, tokens: Sequence[int], key: Any) -> Node | None:
        node, at = self._roots.get(key), 0
        while node is not None and at < len(tokens):
            child = node.children.get(tokens[at])
            if child is None or tuple(tokens[at : at + len(child.edge)]) != child.edge:
                return None
            at += len(child.edge)
            node = child
        return node if node is not None and node.depth == len(tokens) else None

    def _make_path(self, tokens: tuple[int, ...], key: Any) -> Node:
        node = self._roots.setdefault(key, Node((), 0))
        at = 0
        while at < len(tokens):
            child = node.children.get(tokens[at])
            if child is None:
                new = Node(tokens[at:], len(tokens), node)
                node.children[tokens[at]] = new
                return new
            common = _common_prefix(child.edge, tokens[at:])
            if common < len(child.edge):  # split the edge at the divergence
                mid = Node(child.edge[:common], node.depth + common, node)
                node.children[tokens[at]] = mid
                child.edge = child.edge[common:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                child = mid
            at += common
            node = child
        return node


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
