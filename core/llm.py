"""The offline Python API: `tensorfold.LLM(family=..., model=...).generate(prompts, sampling)`.
Every request goes through the lanes, as the server's do."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, Union

from .requests import Event, Finished, TokenOut
from .sampling import SamplingParams
from .logs import get_logger
from .settings import Settings
from .start import Served, open_served

log = get_logger("tensorfold.llm")

Prompt = Union[str, Sequence[int]]


@dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    seed: int | None = None
    cached_tokens: int = 0
    error: str | None = None


class _Collector:
    def __init__(self, completion: Completion, done: threading.Event):
        self.completion = completion
        self.done = done

    def __call__(self, event: Event) -> None:
        c = self.completion
        if isinstance(event, TokenOut):
            c.token_ids.append(event.token)
            c.text += event.text
            c.logprobs.append(event.logprob)
            c.top_logprobs.append(event.top_logprobs)
        elif isinstance(event, Finished):
            c.text += event.text
            c.finish_reason = event.reason
            c.seed = event.seed
            c.cached_tokens = event.cached_tokens
            c.error = event.error
            self.done.set()


class LLM:
    """A served model in this process. Settings come from TF_* variables, overridden by the
    keyword arguments (the same names as Settings' fields: parallel, context, kv_pages, ...)."""

    def __init__(self, family: str | None = None, model: str | Path | None = None, **flags: Any):
        self._open(Settings().with_overrides(**flags), family, model)

    @classmethod
    def from_settings(
        cls, settings: Settings, family: str | None = None, model: str | Path | None = None
    ) -> "LLM":
        llm = cls.__new__(cls)
        llm._open(settings, family, model)
        return llm

    def _open(self, settings: Settings, family: str | None, model: str | Path | None) -> None:
        self.settings = settings
        self.served: Served = open_served(settings, family, model)
        self.tokenizer = self.served.tokenizer
        for line in self.served.start_lines():  # the offline API says them as log lines
            log.info(line)

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return [int(t) for t in prompt]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run every prompt through the lanes at once; returns completions in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling if isinstance(sampling, Sequence) else [sampling or SamplingParams()] * len(prompts)
        return self._run([(self.encode(prompt), ()) for prompt in prompts], params)

    def chat(
        self,
        conversations: Sequence[Sequence[dict]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Render each conversation with the checkpoint's chat template (add_generation_prompt)
        and complete it; the turns' ends are marks where the prompt store keeps states."""
        from .chat_template import marks_to_token_positions, render_chat

        template = self.tokenizer.chat_template
        if template is None:
            raise ValueError("the checkpoint has no chat template")
        params = sampling if isinstance(sampling, Sequence) else [sampling or SamplingParams()] * len(conversations)
        runs = []
        for messages in conversations:
            chat = render_chat(
                template, list(messages), bos_token=self.tokenizer.bos_token,
                eos_token=self.tokenizer.eos_token,
            )
            ids = self.tokenizer.encode(chat.text)
            runs.append((ids, marks_to_token_positions(self.tokenizer, chat.text, chat.marks)))
        return self._run(runs, params)

    def _run(self, runs, params) -> list[Completion]:
        if len(params) != len(runs):
            raise ValueError(f"{len(runs)} prompts but {len(params)} sampling params")
        waits = []
        for (ids, marks), p in zip(runs, params):
            done = threading.Event()
            completion = Completion(ids)
            self.served.engine.submit(ids, p, _Collector(completion, done), marks)
            waits.append((completion, done))
        for _, done in waits:
            done.wait()
        return [c for c, _ in waits]

    def close(self) -> None:
        self.served.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
