"""The stored responses of /v1/responses: a bounded LRU (TF_RESPONSES_STORE entries; 0 stores
none) of each response and the conversation it ended, which a follow-up's previous_response_id
resumes. It lives on the event loop (the app's RESPONSES key): only handlers touch it."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass(frozen=True)
class StoredResponse:
    """A response as GET returns it, the chat messages a follow-up renders after its
    instructions (its input and its output as an assistant turn), and its input items."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    input_items: list[dict[str, Any]] = field(default_factory=list)


class ResponsesStore:
    """At most `capacity` stored responses; storing past it forgets the least recently used."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._kept.get(response_id)
        if stored is not None:
            self._kept.move_to_end(response_id)
        return stored

    def put(self, stored: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._kept[stored.response["id"]] = stored
        self._kept.move_to_end(stored.response["id"])
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._kept.pop(response_id, None) is not None


RESPONSES: web.AppKey[ResponsesStore] = web.AppKey("responses", ResponsesStore)
