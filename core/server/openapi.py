"""`GET /openapi.json`: the OpenAPI 3.1 document of the server, and `GET /docs`, a page that
lists it.

The document is built from the app's router (every route it registers, and no other) and from
api_fields.FIELDS (each route's body), so that it says what the checks check. The responses of
the main routes and the error body are described here.

`/docs` is a plain HTML page written from the same document: the viewer packages that serve
Swagger UI offline either ship a Swagger UI that cannot read OpenAPI 3.1 (swagger-ui-bundle
1.1.0 has 4.15.5) or are little-used forks, so none is a dependency.
"""

from __future__ import annotations

import html
import importlib.metadata
import json
from typing import Any

from aiohttp import web

from .api_fields import route_fields
from .api_key import needs_key

OPENAPI_VERSION = "3.1.0"
ERROR_REF = {"$ref": "#/components/schemas/Error"}
_METHODS = ("get", "post", "put", "patch", "delete", "head", "options")
_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string", "examples": ["invalid_request_error"]},
                "param": {"type": ["string", "null"], "description": "the field at fault"},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_USAGE = {
    "type": "object",
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {
            "type": "object",
            "properties": {"cached_tokens": {"type": "integer"}},
        },
    },
}
_TOOL_CALL = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}


def _reply(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"const": kind},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "seed": {"type": "integer"},
            "choices": {"type": "array", "items": {"type": "object", "properties": choice}},
            "usage": {"$ref": "#/components/schemas/Usage"},
        },
    }


_FINISH = {"type": ["string", "null"], "enum": ["stop", "length", "tool_calls", "abort", None]}
_SCHEMAS: dict[str, Any] = {
    "Error": _ERROR,
    "Usage": _USAGE,
    "ChatCompletion": _reply(
        "chat.completion",
        {
            "index": {"type": "integer"},
            "finish_reason": _FINISH,
            "logprobs": {"type": ["object", "null"]},
            "message": {
                "type": "object",
                "properties": {
                    "role": {"const": "assistant"},
                    "content": {"type": ["string", "null"]},
                    "tool_calls": {"type": "array", "items": _TOOL_CALL},
                },
            },
        },
    ),
    "Completion": _reply(
        "text_completion",
        {
            "index": {"type": "integer"},
            "finish_reason": _FINISH,
            "logprobs": {"type": ["object", "null"]},
            "text": {"type": "string"},
        },
    ),
    "Model": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "max_model_len": {"type": "integer"},
            "capabilities": {
                "type": "array",
                "items": {"enum": ["completion", "vision"]},
                "description": '"vision" when the model takes image_url parts',
            },
            "input_modalities": {
                "type": "array",
                "items": {"enum": ["text", "image", "video", "audio"]},
            },
        },
    },
    "Tokenized": {
        "type": "object",
        "required": ["count", "max_model_len", "tokens", "token_strs"],
        "properties": {
            "count": {"type": "integer"},
            "max_model_len": {"type": "integer"},
            "tokens": {"type": "array", "items": {"type": "integer"}},
            "token_strs": {"type": ["array", "null"], "items": {"type": "string"}},
        },
    },
    "Detokenized": {
        "type": "object",
        "required": ["prompt"],
        "properties": {"prompt": {"type": "string"}},
    },
}


def _json(ref: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}


_STREAMED = {"text/event-stream": {"schema": {"type": "string"}}}
# What a 200 carries, by route; routes not listed answer a short description only.
_OK: dict[str, tuple[str, dict[str, Any]]] = {
    "/v1/chat/completions": (
        "The reply (or, with stream, its chunks as server-sent events)",
        {**_json("ChatCompletion"), **_STREAMED},
    ),
    "/v1/completions": (
        "The completion (or, with stream, its chunks as server-sent events)",
        {**_json("Completion"), **_STREAMED},
    ),
    "/v1/models": (
        "The served model",
        {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "object": {"const": "list"},
                        "data": {
                            "type": "array",
                            "items": {"$ref": "#/components/schemas/Model"},
                        },
                    },
                }
            }
        },
    ),
    "/v1/models/{name}": ("The model", _json("Model")),
    "/tokenize": ("The prompt's tokens", _json("Tokenized")),
    "/detokenize": ("The tokens' text", _json("Detokenized")),
    "/health": (
        "The engine runs and the server is not stopping (else 503)",
        {
            "application/json": {
                "schema": {"type": "object", "properties": {"status": {"const": "ok"}}}
            }
        },
    ),
    "/metrics": ("Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}}),
    "/openapi.json": ("This document", {"application/json": {"schema": {"type": "object"}}}),
}
_SUMMARIES = {
    "/v1/chat/completions": "Chat completion (OpenAI)",
    "/v1/completions": "Text completion (OpenAI)",
    "/v1/models": "The served model (OpenAI)",
    "/v1/models/{name}": "A model by name (OpenAI)",
    "/tokenize": "A prompt or a chat's token ids (vLLM)",
    "/detokenize": "Token ids' text (vLLM)",
    "/health": "Liveness",
    "/metrics": "Prometheus metrics",
    "/openapi.json": "This document",
    "/docs": "This document as a page",
    "/": "Redirects to /status",
    "/status": "The live status page",
    "/status/events": "The status page's server-sent events",
    "/status/{name}": "The status page's script and style",
}


def router_paths(app: web.Application) -> dict[str, set[str]]:
    """The app's routes: each path as OpenAPI writes it ({name}, no regex) -> its methods."""
    paths: dict[str, set[str]] = {}
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        if path is None or route.method == "*":
            continue
        paths.setdefault(path, set()).add(route.method.lower())
    return paths


def _parameters(path: str) -> list[dict[str, Any]]:
    names = [part[1:-1] for part in path.split("/") if part.startswith("{")]
    return [
        {"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in names
    ]


def _body(path: str) -> dict[str, Any] | None:
    fields = route_fields(path)
    if not fields:
        return None
    schema = {
        "type": "object",
        "properties": {name: row.json_schema() for name, row in sorted(fields.items())},
    }
    required = sorted(name for name, row in fields.items() if row.required)
    if required:
        schema["required"] = required
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _operation(path: str, method: str) -> dict[str, Any]:
    description, content = _OK.get(path, ("OK", {}))
    ok: dict[str, Any] = {"description": description}
    if content and method != "head":
        ok["content"] = content
    op: dict[str, Any] = {
        "summary": _SUMMARIES.get(path, path) + (" (headers only)" if method == "head" else ""),
        "operationId": f"{method}_{path.strip('/').replace('/', '_') or 'root'}".translate(
            str.maketrans("{}.", "__-")
        ),
        "responses": {
            "200": ok,
            "default": {
                "description": "An error, as OpenAI shapes it",
                "content": {"application/json": {"schema": ERROR_REF}},
            },
        },
    }
    if parameters := _parameters(path):
        op["parameters"] = parameters
    if method == "post" and (body := _body(path)) is not None:
        op["requestBody"] = body
    if needs_key(path):
        op["security"] = [{}, {"bearer": []}]  # the key only where the server has one
    return op


def build_document(app: web.Application, version: str | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `app`."""
    paths = {
        path: {m: _operation(path, m) for m in _METHODS if m in methods}
        for path, methods in sorted(router_paths(app).items())
    }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "tensorfold",
            "version": version or importlib.metadata.version("tensorfold"),
            "description": "An OpenAI-compatible server (docs/serving.md). Fields that OpenAI "
            "defines and this server does not read are ignored.",
        },
        "paths": paths,
        "components": {
            "schemas": _SCHEMAS,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "--api-key: required on /v1/ routes, /tokenize and /detokenize "
                    "when the server has one",
                }
            },
        },
    }


def docs_page(document: dict[str, Any]) -> str:
    """A page listing the document's routes and each body's fields."""
    out = [
        "<!doctype html><html><head><meta charset='utf-8'><title>tensorfold API</title>",
        "<style>body{font:14px sans-serif;max-width:60em;margin:2em auto}"
        "td,th{text-align:left;vertical-align:top;padding:2px 8px}code{font-size:13px}</style>",
        "</head><body><h1>tensorfold API</h1>",
        "<p>The machine-readable document: <a href='/openapi.json'>/openapi.json</a>.</p>",
    ]
    for path, ops in document["paths"].items():
        for method, op in ops.items():
            if method == "head":
                continue
            out.append(f"<h2><code>{method.upper()} {html.escape(path)}</code></h2>")
            out.append(f"<p>{html.escape(op['summary'])}</p>")
            body = op.get("requestBody", {}).get("content", {}).get("application/json")
            if body is None:
                continue
            schema = body["schema"]
            out.append("<table><tr><th>field</th><th>schema</th><th>description</th></tr>")
            for name, prop in schema["properties"].items():
                shape = {k: v for k, v in prop.items() if k != "description"}
                star = " (required)" if name in schema.get("required", ()) else ""
                out.append(
                    f"<tr><td><code>{html.escape(name)}</code>{star}</td>"
                    f"<td><code>{html.escape(json.dumps(shape)[:200])}</code></td>"
                    f"<td>{html.escape(prop['description'])}</td></tr>"
                )
            out.append("</table>")
    out.append("</body></html>")
    return "\n".join(out)


def install(app: web.Application) -> None:
    """Add /openapi.json and /docs; the document is built on the first request, once every
    route is in place (routes cannot be added once the app runs)."""
    built: dict[str, bytes] = {}

    def document() -> bytes:
        if "json" not in built:
            doc = build_document(app)
            built["json"] = json.dumps(doc).encode()
            built["html"] = docs_page(doc).encode()
        return built["json"]

    async def openapi(request: web.Request) -> web.Response:
        return web.Response(body=document(), content_type="application/json")

    async def docs(request: web.Request) -> web.Response:
        document()
        return web.Response(body=built["html"], content_type="text/html", charset="utf-8")

    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/docs", docs)
