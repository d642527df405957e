"""Every core TF_* variable in one typed class; the only module that reads os.environ.

CLI flags override the environment through `Settings.with_overrides`. Plugins read their own
TF_* variables through `Settings.plugin_value`, and declare them as profile rows so that
`check_environment` knows them.
"""

from __future__ import annotations

import os
import re
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union

from pydantic import Field, PositiveInt, PrivateAttr, ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from tensorfold.config.logs import get_logger

if TYPE_CHECKING:
    from tensorfold.family.profiles import ProfileRow

PREFIX = "TF_"
log = get_logger("tensorfold.settings")


class SettingsError(Exception):
    """A TF_* variable or a flag has a value the engine refuses; the message says which."""


class Settings(BaseSettings):
    """The engine's settings, read from TF_* variables (flags override them)."""

    model_config = SettingsConfigDict(env_prefix=PREFIX, extra="ignore", frozen=True)

    plugins: str | None = Field(
        default=None,
        description="Plugins to load, as comma-separated entry-point names. Unset: every "
        "installed plugin; empty: none.",
        json_schema_extra={"values": "comma-separated entry-point names"},
    )
    family: str | None = Field(
        default=None,
        description="The model family served when --family is not given. Unset: the one "
        "that serves --model's config.json (its model_type / architectures), else the only "
        "installed family, or of several the default one (lfm2_moe when installed).",
        json_schema_extra={"values": "an installed family's name"},
    )
    kv_pages: Literal["auto", "on", "off", "0"] = Field(
        default="auto",
        description="Paged KV cache: on, off (0 is off: every lane owns a window), or auto "
        "(pages when they serve the requested lanes).",
    )
    kv_dtype: Literal["auto", "fp8"] = Field(
        default="auto",
        description="The dtype of paged KV rows (--kv-dtype): auto keeps the model's; fp8 "
        "stores the family's attention rows in float8 e4m3 with a float32 scale a row and head "
        "beside them (about half the bytes, so about twice the tokens in the same memory).",
    )
    quantization: Literal["auto", "fp8"] = Field(
        default="auto",
        description="Weight quantization (--quantization): auto keeps the checkpoint's weights "
        "as stored (an FP8 checkpoint's in fp8); fp8 quantizes a bf16 checkpoint's linears "
        "(attention, FFNs, experts) to float8 e4m3 with 128 x 128 block scales as they load, "
        "about half their bytes (docs/fp8.md).",
    )
    kv_poison: bool = Field(
        default=False,
        description="Fill freed and detached pages with NaN, so that a stale read changes tokens.",
    )
    cuda_graphs: bool = Field(
        default=True,
        description="On CUDA, replay decode rounds as CUDA graphs (0: run every pass eagerly, "
        "for debugging; the tokens are the same).",
    )
    dependent_launch: bool = Field(
        default=True,
        description="On Hopper GPUs and newer, launch the kernels with programmatic dependent "
        "launch, so that each starts while the one before it finishes (0: plain launches; the "
        "tokens are the same).",
    )
    prefetch_weights: bool = Field(
        default=False,
        description="With dependent launch, let each GEMV kernel prefetch part of its weights "
        "into L2 while the kernel before it finishes (off: slower on an H200, docs/performance.md, "
        '"PREFETCH_WEIGHTS"; the tokens are the same either way).',
    )
    warm_up: bool | None = Field(
        default=None,
        description="Before serving, run a few prompts and decode rounds through the lanes so "
        "that kernels compile, autotune and capture their graphs at start, not in the first "
        "request (unset: on for CUDA, off on the CPU; 0: off; 1: on).",
    )
    kv_share: int | None = Field(
        default=None,
        ge=0,
        description="The prompt store: how many kept states it may hold in all (unset or empty: "
        "on, sized from what the memory plan leaves for the prompt cache, at least 4 a lane; "
        "0: off).",
    )
    kv_host_gib: float | None = Field(
        default=None,
        ge=0,
        description="The prompt store's host-memory tier, in GiB: kept states the device store "
        "evicts move there (pinned on CUDA) and a later hit copies them back instead of "
        "prefilling (unset: a quarter of the host memory available at start; 0: off).",
    )
    memory_limit_gib: float | None = Field(
        default=None,
        gt=0,
        description="Memory the KV plan may use, in GiB: on CUDA a cap on free device memory "
        "(unset: all of it); on the CPU the budget itself (unset: 2).",
    )
    parallel: Literal["auto"] | PositiveInt = Field(
        default=1,
        description="Lanes (streams decoded together); auto takes as many as the memory plan fits.",
    )
    context: PositiveInt | None = Field(
        default=None,
        description="The window a stream may reach, in tokens (unset: the model's maximum).",
    )
    prompt_cache_gib: float = Field(
        default=16.0,
        ge=0,
        description="Memory budget of the prompt store and its snapshot arena, in GiB.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="Where the model runs (auto: cuda when there is one)."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="Weight and activation dtype (auto: the checkpoint's, float32 on the cpu).",
    )
    load_format: Literal["auto", "dummy"] = Field(
        default="auto",
        description="Weights: auto reads the checkpoint's safetensors; dummy draws random ones in "
        "place from a fixed seed (benchmarks; only config.json and the tokenizer are read).",
    )
    tp: PositiveInt = Field(
        default=1,
        description="Tensor-parallel ranks on this host (--tp): rank 0 serves and starts the "
        "others; under torchrun, WORLD_SIZE says instead.",
    )
    tp_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="Seconds a tensor-parallel rank may keep the others waiting (a collective, "
        "or a follower joining at start) before the server stops with an error.",
    )
    tp_reduce: Literal["symmetric", "nccl"] = Field(
        default="symmetric",
        description="How CUDA ranks sum their partials. symmetric: messages up to 8 MiB (decode "
        "rounds) in one kernel over symmetric memory, larger ones through NCCL; where the "
        "symmetric buffers cannot be set up, NCCL, and the start says why. nccl: always an "
        "NCCL all_gather. Both sum in rank order in fp32: the same bits. Gloo on the CPU "
        "ignores it.",
    )
    grammar_lexer_fuel: PositiveInt = Field(
        default=1_000_000,
        description="Structured output: the work a grammar's lexer may take to build (llguidance's "
        "initial_lexer_fuel, about 50 a microsecond), spent while the request is parsed; a "
        "grammar past it is a 400 naming its field.",
    )
    grammar_step_fuel: PositiveInt = Field(
        default=200_000,
        description="Structured output: the lexer work one token's mask may take (llguidance's "
        "step_lexer_fuel); a grammar past it is a 400 when parsed, or ends its stream with an "
        "error naming its field mid-generation.",
    )
    grammar_step_items: PositiveInt = Field(
        default=50_000,
        description="Structured output: the parser items one token's mask may take "
        "(llguidance's step_max_items); past it, as TF_GRAMMAR_STEP_FUEL.",
    )
    grammar_max_size: PositiveInt = Field(
        default=500_000,
        description="Structured output: the largest grammar, in symbols (llguidance's "
        "max_grammar_size); a schema, regex or grammar past it is a 400 naming its field.",
    )
    log_format: Literal["console", "json"] = Field(
        default="console",
        description="Log lines: readable console lines, or one JSON object a line.",
    )
    log_level: Literal["debug", "info", "warning", "error", "critical"] = Field(
        default="info", description="The lowest level of log lines printed."
    )
    allowed_origins: str | None = Field(
        default=None,
        description="Origins whose web pages may call the server (CORS; --allowed-origins): "
        "a comma-separated list such as https://app.example.com,http://localhost:5173, or * "
        "for any. Unset: none, and no CORS header is sent.",
        json_schema_extra={"values": "comma-separated origins (scheme://host[:port]), or *"},
    )
    allowed_media_domains: str | None = Field(
        default=None,
        description="Hosts whose http(s) image URLs chat requests may name "
        "(--allowed-media-domains): a comma-separated list such as "
        "upload.wikimedia.org,images.example.com, each matched exactly; the server fetches "
        "them within TF_MAX_IMAGE_MIB and TF_MEDIA_FETCH_TIMEOUT_S, and follows a redirect "
        "only to a listed host. Unset: none (images come as data: URLs only).",
        json_schema_extra={"values": "comma-separated host names"},
    )
    max_images: PositiveInt = Field(
        default=8,
        description="The most images one request may hold (image_url parts over all its "
        "messages); more get 400 before any is decoded.",
    )
    max_image_mib: float = Field(
        default=20.0,
        gt=0,
        description="The largest image a request may hold, in MiB of its encoded bytes (a data "
        "URL's decoded, a fetched URL's body); a larger one gets 400. The request body's limit "
        "(TF_MAX_BODY_MIB) bounds data URLs as well.",
    )
    max_image_pixels: PositiveInt = Field(
        default=8192 * 8192,
        description="The most pixels (width x height) an image may have; its header is read "
        "first, so a larger one gets 400 before it is decoded (a decompression bomb costs "
        "nothing).",
    )
    max_audio_clips: PositiveInt = Field(
        default=4,
        description="The most audio clips one request may hold (input_audio parts over all its "
        "messages); more get 400 before any is decoded.",
    )
    max_audio_mib: float = Field(
        default=10.0,
        gt=0,
        description="The largest audio clip a request may hold, in MiB of its encoded bytes "
        "(an input_audio part's base64 data decoded); a larger one gets 400. The request "
        "body's limit (TF_MAX_BODY_MIB) bounds it as well.",
    )
    max_audio_seconds: float = Field(
        default=30.0,
        gt=0,
        description="The longest audio clip a request may hold, in seconds, read from its WAV "
        "header before a sample is decoded; a longer one gets 400. The family may take less "
        "(Gemma 4: 30 s, 750 audio tokens).",
    )
    media_fetch_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="Seconds the server may spend fetching one image URL (redirects included); "
        "a slower one gets 400.",
    )
    api_key: str | None = Field(
        default=None,
        description="The key `serve` requires as `Authorization: Bearer KEY` on /v1/ routes "
        "(--api-key and --api-key-file win over it; unset or empty: no key).",
        json_schema_extra={"values": "text"},
    )
    max_body_mib: float = Field(
        default=8.0,
        gt=0,
        description="The largest request body `serve` reads, in MiB (--max-body-mib); a larger "
        "one gets 413 before it is read.",
    )
    read_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Seconds a client may take to send a request's headers, and again its body, "
        "before `serve` answers 408 or closes the connection; also how long an idle "
        "connection is kept.",
    )
    max_connections: PositiveInt = Field(
        default=1024,
        description="Connections `serve` keeps open at once. At the cap, the connection idle "
        "longest (silent since it opened or since its last reply) is closed to make room; when "
        "none is idle, one more is answered 503 and closed (GET /health and GET /metrics are "
        "still answered).",
    )
    max_client_connections: PositiveInt = Field(
        default=256,
        description="Connections `serve` keeps open at once from one client address, as "
        "TF_MAX_CONNECTIONS does for all (behind a proxy every client has its address: raise "
        "it to TF_MAX_CONNECTIONS there).",
    )
    first_byte_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="Seconds a new connection may stay silent: one that sends no byte of a "
        "request within it is closed.",
    )
    special_tokens_in_content: bool = Field(
        default=False,
        description="Read special-token strings (such as <|im_end|>) in the content of chat "
        "messages other than the assistant's (system, developer, user, tool) as the control "
        "tokens they spell, for trusted callers that write turns themselves (0: they are "
        "tokenized as text, so that a user cannot end a turn or forge one).",
    )
    reasoning: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Thinking for chat requests that do not say (--reasoning): on or off sets "
        "the chat template's enable_thinking to true or false when a request sets neither "
        "chat_template_kwargs.enable_thinking nor reasoning_effort none; auto passes nothing, "
        "so the template's own default rules.",
    )
    access_log: bool = Field(
        default=True,
        description="`serve` logs one info line a request, at its end: method, route, status, "
        "prompt, completion and cached tokens, time to first token, duration (--no-access-log "
        "or 0: none; GET /health and GET /metrics only when they fail).",
    )
    draft: Literal["off", "ngram", "model", "mtp"] = Field(
        default="off",
        description="Drafts for every stream (--draft), verified so the tokens are plain "
        "decoding's: ngram looks the stream's last tokens up in its prompt and output and "
        "proposes what followed them (pays where replies repeat their input); model: the "
        "family's draft checkpoint at TF_DRAFT_MODEL proposes them; mtp: the checkpoint's own "
        "multi-token-prediction layer (glm5_next's), loaded and run beside the model; off: "
        "none. A request's `prediction` is drafted whatever this says.",
    )
    draft_model: Path | None = Field(
        default=None,
        description="The draft checkpoint's folder for --draft model (--draft-model), e.g. "
        "Gemma 4's gemma-4-*-assistant for a Gemma 4 target; the family must have a draft model "
        "(the model_drafter hook).",
        json_schema_extra={"values": "a folder"},
    )
    draft_tokens: int = Field(
        default=4,
        ge=1,
        le=16,
        description="The most drafts a stream proposes a round (--draft-tokens, k): a verify "
        "round feeds k + 1 rows; each stream drafts fewer while its drafts are refused.",
    )
    max_messages: PositiveInt = Field(
        default=4096,
        description="The most messages a chat request may hold; more get 400 before the chat "
        "template runs.",
    )
    responses_store: int = Field(
        default=1024,
        ge=0,
        description="Responses /v1/responses keeps (store: true, the default) for retrieval and "
        "for a follow-up's previous_response_id, the least recently used forgotten past it "
        "(0: none kept, and previous_response_id is refused).",
    )
    prepare_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Seconds `serve` may spend preparing a request once its body has arrived "
        "(its JSON, the chat template, the tokenizer); a longer one gets 400 and its work is "
        "stopped.",
    )
    prepare_workers: PositiveInt = Field(
        default=2,
        description="Worker processes `serve` runs the chat template and the tokenizer in, off "
        "the event loop and the engine; a request waits for a free one.",
    )
    demo_cache: Path = Field(
        default=Path("~/.cache/tensorfold/demo"),
        validate_default=True,
        description="Where demo checkpoints are built when no --model is given.",
        json_schema_extra={"values": "a folder"},
    )

    _environ: dict[str, str] = PrivateAttr(default_factory=dict)

    def __init__(self, _flags: tuple[str, ...] = (), **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            # _flags: the fields a CLI flag set, so that the error names the flag.
            raise SettingsError(_explain(exc, _flags)) from None
        self._environ = {k: v for k, v in os.environ.items() if k.startswith(PREFIX)}

    @field_validator("*", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any, info: Any) -> Any:
        # TF_X= (empty) means "unset" except for TF_PLUGINS, where empty means "no plugins".
        if value == "" and info.field_name != "plugins":
            return cls.model_fields[info.field_name].get_default(call_default_factory=True)
        return value

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, value: str | None) -> str | None:
        if value is None:
            return None
        origins = parse_origins(value)
        return ",".join(origins) if origins else None

    @field_validator("allowed_media_domains")
    @classmethod
    def _media_domains(cls, value: str | None) -> str | None:
        if value is None:
            return None
        hosts = parse_hosts(value)
        return ",".join(hosts) if hosts else None

    @field_validator("demo_cache")
    @classmethod
    def _expand_home(cls, value: Path) -> Path:
        return value.expanduser()

    @property
    def paging(self) -> Literal["auto", "on", "off"]:
        """TF_KV_PAGES with "0" read as "off"."""
        return "off" if self.kv_pages == "0" else self.kv_pages

    @property
    def origins(self) -> tuple[str, ...]:
        """TF_ALLOWED_ORIGINS as a tuple: () when unset, ("*",) for any origin."""
        return tuple(self.allowed_origins.split(",")) if self.allowed_origins else ()

    @property
    def media_domains(self) -> tuple[str, ...]:
        """TF_ALLOWED_MEDIA_DOMAINS as a tuple of host names: () when unset."""
        return tuple(self.allowed_media_domains.split(",")) if self.allowed_media_domains else ()

    @property
    def environ(self) -> dict[str, str]:
        """The TF_* variables as they were when these settings were read."""
        return dict(self._environ)

    def plugin_value(self, name: str) -> str | None:
        """A plugin's own TF_* variable (full name, e.g. "TF_GLM_FOO"), or None when unset."""
        if not name.startswith(PREFIX):
            raise ValueError(f"plugin settings are named {PREFIX}*, got {name!r}")
        return self._environ.get(name)

    def with_overrides(self, **flags: Any) -> Settings:
        """A copy with the non-None flags applied (flags win over the environment)."""
        unknown = sorted(set(flags) - set(type(self).model_fields))
        if unknown:
            raise TypeError(f"not settings: {', '.join(unknown)}")
        updates = {k: v for k, v in flags.items() if v is not None}
        if not updates:
            return self
        return type(self)(_flags=tuple(updates), **{**self.model_dump(), **updates})


_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s,?#]+")


def parse_origins(value: str) -> tuple[str, ...]:
    """A comma-separated list of origins (scheme://host[:port], lower-cased, without a
    trailing slash) or "*" alone; raises ValueError naming a malformed one."""
    origins = tuple(o.strip().lower().rstrip("/") for o in value.split(",") if o.strip())
    if "*" in origins:
        if len(origins) > 1:
            raise ValueError("* allows every origin and cannot be listed with others")
        return origins
    for origin in origins:
        if not _ORIGIN.fullmatch(origin):
            raise ValueError(f"{origin!r} is not an origin such as https://app.example.com")
    return origins


_HOST = re.compile(
    r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*|\[[0-9a-f:.]+\]"
)


def parse_hosts(value: str) -> tuple[str, ...]:
    """A comma-separated list of host names (lower-cased; no scheme, port or path); raises
    ValueError naming a malformed one."""
    hosts = tuple(h.strip().lower().rstrip(".") for h in value.split(",") if h.strip())
    for host in hosts:
        if not _HOST.fullmatch(host):
            raise ValueError(
                f"{host!r} is not a host name such as images.example.com (no scheme, port or path)"
            )
    return hosts


@dataclass(frozen=True)
class TorchrunEnv:
    """Where torchrun (or any launcher that sets these) placed this process."""

    rank: int
    world: int
    local_rank: int
    master_addr: str
    master_port: int


def torchrun_env() -> TorchrunEnv | None:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, when a launcher set them
    (None when WORLD_SIZE is unset). Raises SettingsError on a malformed value."""
    env = os.environ
    if "WORLD_SIZE" not in env:
        return None
    try:
        launch = TorchrunEnv(
            rank=int(env.get("RANK", "0")),
            world=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", env.get("RANK", "0"))),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
        )
    except ValueError as exc:
        raise SettingsError(f"torchrun's variables are malformed: {exc}") from None
    if not 0 <= launch.rank < launch.world:
        raise SettingsError(f"RANK={launch.rank} is not in 0..WORLD_SIZE-1={launch.world - 1}")
    return launch


def env_name(field: str) -> str:
    """The variable that sets a field: kv_pages -> TF_KV_PAGES."""
    return PREFIX + field.upper()


def accepted_values(field: FieldInfo) -> str:
    """The values a field accepts, in words, derived from its type (so they never drift)."""
    extra = field.json_schema_extra
    if isinstance(extra, dict) and "values" in extra:
        return str(extra["values"])
    words: list[str] = []
    for part in _union_parts(field.annotation):
        metadata = list(field.metadata)
        if typing.get_origin(part) is typing.Annotated:
            part, *more = typing.get_args(part)
            metadata += more
        if typing.get_origin(part) is Literal:
            words += [str(a) for a in typing.get_args(part)]
        elif part is bool:
            words += ["0", "1"]
        elif part in (int, float):
            words.append(("an integer" if part is int else "a number") + _bounds(metadata))
        elif part is not type(None):
            words.append("text")
    return ", ".join(words)


def _union_parts(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _bounds(metadata: list[Any]) -> str:
    for item in metadata:
        if getattr(item, "gt", None) is not None:
            return f" > {item.gt}"
        if getattr(item, "ge", None) is not None:
            return f" >= {item.ge}"
    return ""


def _explain(exc: ValidationError, flags: Iterable[str] = ()) -> str:
    """One line per refused setting: its name (the flag when a flag set it), value, accepted."""
    lines: dict[str, str] = {}
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        info = Settings.model_fields.get(field)
        if info is None:
            lines[err["msg"]] = err["msg"]
            continue
        name = "--" + field.replace("_", "-") if field in flags else env_name(field)
        lines[field] = (
            f"{name}={err.get('input')!s} is not valid; accepted values: {accepted_values(info)}"
        )
    return "; ".join(lines.values())


# Other tools' TF_* variables (Terraform's, TensorFlow's): not ours, so not worth a warning.
FOREIGN_PREFIXES = (
    "TF_CLI_",
    "TF_VAR_",
    "TF_LOG",
    "TF_DATA_DIR",
    "TF_IN_AUTOMATION",
    "TF_INPUT",
    "TF_WORKSPACE",
    "TF_PLUGIN_CACHE_DIR",
    "TF_REGISTRY_",
    "TF_CPP_",
    "TF_ENABLE_",
    "TF_FORCE_",
    "TF_GPU_",
    "TF_XLA_",
    "TF_NUM_",
)


def check_environment(settings: Settings, rows: Iterable[ProfileRow]) -> list[str]:
    """Check the TF_* environment before any weights load.

    Warns about TF_* names that neither the core nor any profile row knows, and returns them.
    Raises SettingsError for a retired setting (a row with `replaced_by`) set to anything but
    "" or "0", naming the variable, its value and the replacement.
    """
    rows = list(rows)
    known = {env_name(f) for f in Settings.model_fields} | {row.setting for row in rows}
    environ = settings.environ
    retired = [
        f"{row.setting} is retired; use {row.replaced_by} instead "
        f"(found {row.setting}={environ[row.setting]})"
        for row in rows
        if row.replaced_by and environ.get(row.setting, "") not in ("", "0")
    ]
    if retired:
        raise SettingsError("; ".join(retired))
    unknown = sorted(
        name for name in environ if name not in known and not name.startswith(FOREIGN_PREFIXES)
    )
    if unknown:
        log.warning("unknown TF_* variables are ignored", names=unknown)
    return unknown
