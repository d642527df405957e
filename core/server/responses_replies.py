"""OpenAI's Responses API, the reply side: a chat reply (openai_replies' shapes) -> a `response`
object, whole or as the stream of events OpenAI names (response.created, ...,
response.completed), each with its sequence_number, as server-sent events with `event:` lines.

The chat shapes are read with `.get`, so a reply's `reasoning_content` (and its stream's
`delta.reasoning_content`, and usage's `completion_tokens_details.reasoning_tokens`) become a
reasoning item and reasoning_tokens wherever the chat reply carries them.
"""

from __future__ import annotations

import json
import time
from typing import Any

from .openai_replies import dumps
from .responses_api import ResponsesRequest, new_id

_STATUS = {  # the chat finish_reason -> the response's status
    "stop": "completed",
    "tool_calls": "completed",
    "length": "incomplete",
    "abort": "cancelled",
    "error": "failed",
}


def usage(chat: dict[str, Any] | None) -> dict[str, Any] | None:
    """The chat usage in the Responses shape."""
    if chat is None:
        return None
    details = chat.get("completion_tokens_details") or {}
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        },
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
        "total_tokens": chat["total_tokens"],
    }


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [output_text(text)],
    }


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _item_status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def whole_output(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice's message as output items: its reasoning, its text, its calls."""
    message, status = choice["message"], _item_status(choice.get("finish_reason"))
    items = []
    if reasoning := message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), reasoning, status))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(new_id("msg"), message.get("content") or "", status))
    for call in calls:
        function = call["function"]
        items.append(
            function_call_item(
                new_id("fc"), call["id"], function["name"], function["arguments"], status
            )
        )
    return items


def assistant_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """Output items as the chat assistant message a follow-up's conversation holds."""
    turn: dict[str, Any] = {"role": "assistant", "content": None}
    for item in output:
        if item["type"] == "reasoning":
            turn["reasoning_content"] = item["content"][0]["text"]
        elif item["type"] == "message":
            turn["content"] = (turn["content"] or "") + item["content"][0]["text"]
        else:
            call = {"name": item["name"], "arguments": item["arguments"]}
            turn.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function", "function": call}
            )
    if turn["content"] is None and "tool_calls" not in turn:
        turn["content"] = ""
    return turn


class ResponseShape:
    """One response's envelope: its id, creation time, model and the request's echoed fields."""

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.model = model
        self.echo = request.echo

    def response(
        self,
        output: list[dict[str, Any]],
        status: str = "in_progress",
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            "usage": usage,
            **self.echo,
        }

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The response to a whole chat reply (openai_replies.Choices.response())."""
        choice = chat["choices"][0]
        status = _STATUS.get(choice.get("finish_reason") or "stop", "completed")
        return self.response(whole_output(choice), status, usage(chat.get("usage")))


def _opening(kind: str) -> dict[str, Any]:
    """A reasoning or message item as the stream opens it: in progress, no content yet."""
    item_id = new_id("rs" if kind == "reasoning" else "msg")
    item = (reasoning_item if kind == "reasoning" else message_item)(item_id, "", "in_progress")
    return {**item, "content": []}


def _chunks(data: bytes) -> list[dict[str, Any]]:
    """The JSON objects of chat stream events ("data: {...}" blocks; [DONE] skipped)."""
    out = []
    for block in data.split(b"\n\n"):
        body = block.removeprefix(b"data: ").strip()
        if body and body != b"[DONE]":
            out.append(json.loads(body))
    return out


class ResponseStream:
    """A chat reply's stream chunks in, the Responses stream's events out. Items open as their
    first text (or call) comes and close when the next opens or the reply ends."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text: list[str] = []  # its text (or arguments) so far
        self.calls: dict[int, dict[str, Any]] = {}  # a chat call's index -> its item
        self.finish: str | None = None
        self.error: dict[str, Any] | None = None

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(body) + b"\n\n"

    def start(self) -> bytes:
        response = self.shape.response([])
        return self.event("response.created", response=response) + self.event(
            "response.in_progress", response=response
        )

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def _open(self, item: dict[str, Any]) -> bytes:
        out = self._close()
        self.output.append(item)
        self.open, self.text = item, []
        out += self.event(
            "response.output_item.added", output_index=len(self.output) - 1, item=item
        )
        if item["type"] == "function_call":
            return out
        part = {"type": "reasoning_text", "text": ""} if item["type"] == "reasoning" else None
        return out + self.event(
            "response.content_part.added",
            **self._where(),
            content_index=0,
            part=part or output_text(""),
        )

    def _close(self) -> bytes:
        item = self.open
        if item is None:
            return b""
        status = _item_status(self.finish)
        text, where = "".join(self.text), self._where()
        out = b""
        if item["type"] == "function_call":
            item["arguments"] = text
            out += self.event(
                "response.function_call_arguments.done", **where, arguments=text, name=item["name"]
            )
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item["content"] = [part]
            out += self.event("response.reasoning_text.done", **where, content_index=0, text=text)
            out += self.event("response.content_part.done", **where, content_index=0, part=part)
        else:
            part = output_text(text)
            item["content"] = [part]
            out += self.event(
                "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
            )
            out += self.event("response.content_part.done", **where, content_index=0, part=part)
        item["status"] = status
        self.open = None
        return out + self.event(
            "response.output_item.done", output_index=where["output_index"], item=item
        )

    def _text(self, kind: str, text: str) -> bytes:
        out = b""
        if self.open is None or self.open["type"] != kind:
            out += self._open(_opening(kind))
        self.text.append(text)
        if kind == "reasoning":
            return out + self.event(
                "response.reasoning_text.delta", **self._where(), content_index=0, delta=text
            )
        return out + self.event(
            "response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[]
        )

    def _call(self, delta: dict[str, Any]) -> bytes:
        out = b""
        index = delta.get("index", 0)
        function = delta.get("function") or {}
        if index not in self.calls:
            item = function_call_item(
                new_id("fc"), delta.get("id") or "", function.get("name") or "", "", "in_progress"
            )
            self.calls[index] = item
            out += self._open(item)
        if arguments := function.get("arguments"):
            self.text.append(arguments)
            out += self.event(
                "response.function_call_arguments.delta", **self._where(), delta=arguments
            )
        return out

    def feed(self, data: bytes) -> bytes:
        """The events for chat stream events `data` (openai_replies.Reply's sse bytes)."""
        out = b""
        for chunk in _chunks(data):
            if "error" in chunk:
                self.error = {
                    "code": chunk["error"].get("code") or "server_error",
                    "message": chunk["error"]["message"],
                }
                continue
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if reasoning := delta.get("reasoning_content"):
                    out += self._text("reasoning", reasoning)
                if content := delta.get("content"):
                    out += self._text("message", content)
                for call in delta.get("tool_calls") or []:
                    out += self._call(call)
                if choice.get("finish_reason"):
                    self.finish = choice["finish_reason"]
        return out

    def end(self, chat_usage: dict[str, Any] | None) -> tuple[bytes, dict[str, Any]]:
        """The last events: the open item closed (an empty message for a reply that wrote
        nothing), then response.completed, .incomplete or .failed; and the final response."""
        out = b""
        if self.error is None and not self.output:
            out += self._open(_opening("message"))
        out += self._close()
        status = "failed" if self.error else _STATUS.get(self.finish or "stop", "completed")
        if status == "cancelled":
            self.error = {"code": "cancelled", "message": "cancelled: the server is shutting down"}
        response = self.shape.response(self.output, status, usage(chat_usage), self.error)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            status, "response.failed"
        )
        return out + self.event(kind, response=response), response
