"""JSON schemas as users write them, made ready for a family's tool-call grammar: local `$ref`s
(`#/$defs/...`, `#/definitions/...`, `#`, as Pydantic writes nested models) resolved against
their root, and OpenAI's strict mode applied.

Strict mode (OpenAI's structured outputs, `"strict": true` on a tool's function or on
response_format's json_schema): every object in the schema admits no properties but its own,
so each one gets `additionalProperties: false`. OpenAI also requires that every property be
listed in `required`; that is the schema's author's to say, and is not added here.
"""

from __future__ import annotations

from typing import Any, Mapping

REF_ROOTS = ("$defs", "definitions")
_MAX_HOPS = 64  # a $ref chain longer than this is a cycle of bare refs

# keywords whose value is a schema, a list of schemas, or a map of names to schemas
_ONE = (
    "items",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
)
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class SchemaRefError(ValueError):
    """A `$ref` that does not resolve locally; the message says which."""


def resolve(schema: Any, root: Mapping[str, Any]) -> dict[str, Any]:
    """`schema` with its `$ref` followed (within `root`) until it is no bare reference: the
    referenced schema, merged under the referring one's other keywords. Not a dict: {}."""
    if not isinstance(schema, dict):
        return {}
    for _ in range(_MAX_HOPS):
        ref = schema.get("$ref")
        if not isinstance(ref, str):
            return schema
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {**_target(ref, root), **rest}
    raise SchemaRefError(f"$ref chain too long (a cycle?) at {schema.get('$ref')!r}")


def _target(ref: str, root: Mapping[str, Any]) -> dict[str, Any]:
    if ref == "#":
        return dict(root)
    if not ref.startswith("#/"):
        raise SchemaRefError(f"$ref {ref!r}: only local references (#/$defs/...) are served")
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            raise SchemaRefError(f"$ref {ref!r} does not resolve: no {part!r} in the schema")
        node = node[part]
    if not isinstance(node, dict):
        raise SchemaRefError(f"$ref {ref!r} is not a schema (an object)")
    return node


def with_defs(schema: Mapping[str, Any], root: Mapping[str, Any]) -> dict[str, Any]:
    """A sub-schema made whole on its own: `root`'s `$defs` / `definitions` carried along, so
    its `$ref`s resolve where it is compiled alone (a grammar's per-parameter `%json`)."""
    out = dict(schema)
    for key in REF_ROOTS:
        if isinstance(root.get(key), dict):
            out.setdefault(key, root[key])
    return out


def _is_object(schema: Mapping[str, Any]) -> bool:
    kind = schema.get("type")
    return (
        kind == "object"
        or (isinstance(kind, list) and "object" in kind)
        or (kind is None and "properties" in schema)
    )


def strict(schema: Any) -> Any:
    """The schema under OpenAI's strict mode: every object in it (nested, in $defs, in anyOf
    branches, array items) with `additionalProperties: false`. A new schema; the given one is
    left as it was."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [strict(s) for s in out[key]]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict(s) for name, s in out[key].items()}
    if _is_object(out):
        out["additionalProperties"] = False
    return out


def strict_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI tool entry with its parameters under strict mode when it asks for it."""
    function = tool.get("function") or {}
    if function.get("strict") is not True or not isinstance(function.get("parameters"), dict):
        return dict(tool)
    return {**tool, "function": {**function, "parameters": strict(function["parameters"])}}
