"""Prometheus metrics for one served model, in a registry of its own (one per app).

Engine state (lanes, pool pages, the UNEVEN count, device memory) is read when scraped; the
server counts generated tokens as they are sampled, and prompt tokens and token timings as
requests run.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ..engine.engine import Engine

disable_created_metrics()  # the *_created samples only add noise to a scrape

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


def device_memory_peak(device: str) -> int:
    """Peak bytes: torch's allocator peak on cuda, else the process's peak resident set."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.max_memory_allocated())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # kilobytes on Linux


class _EngineCollector(Collector):
    def __init__(self, engine: Engine, device: str, lanes: int) -> None:
        self.engine = engine
        self.device = device
        self.lanes = lanes

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        lanes = GaugeMetricFamily("tensorfold_lanes", "Lanes by state", labels=["state"])
        busy = engine.busy()
        lanes.add_metric(["busy"], busy)
        lanes.add_metric(["free"], self.lanes - busy)
        yield lanes
        yield GaugeMetricFamily(
            "tensorfold_requests_waiting",
            "Requests submitted and not yet on a lane",
            value=engine.waiting(),
        )
        census = engine.lanes.pool.census()
        pages = GaugeMetricFamily("tensorfold_pool_pages", "KV pool pages", labels=["state"])
        for state in ("free", "promised", "store", "live", "shared", "total"):
            pages.add_metric([state], getattr(census, state))
        yield pages
        if census.host is not None:
            host = GaugeMetricFamily(
                "tensorfold_pool_host_pages", "The prompt store's host-tier pages", labels=["state"]
            )
            for state, n in zip(("free", "store", "total"), census.host):
                host.add_metric([state], n)
            yield host
        yield CounterMetricFamily(
            "tensorfold_draft_tokens",
            "Draft tokens verify rounds checked (a prediction's, n-gram's)",
            value=engine.lanes.tokens_drafted,
        )
        yield CounterMetricFamily(
            "tensorfold_draft_tokens_accepted",
            "Draft tokens kept: each one a token the pass gave beyond its row",
            value=engine.lanes.drafts_accepted,
        )
        yield CounterMetricFamily(
            "tensorfold_uneven",
            "Idle censuses that did not add up (a bug)",
            value=engine.lanes.uneven,
        )
        sharing = engine.lanes.sharing
        if sharing is not None:
            yield GaugeMetricFamily(
                "tensorfold_prompt_store_states",
                "States the prompt store keeps",
                value=len(sharing.store),
            )
            yield CounterMetricFamily(
                "tensorfold_prompt_store_evictions",
                "Kept states evicted (LRU)",
                value=sharing.evictions,
            )
            if sharing.host is not None:
                yield GaugeMetricFamily(
                    "tensorfold_prompt_store_host_states",
                    "Kept states in the host tier",
                    value=sharing.on_host,
                )
                yield CounterMetricFamily(
                    "tensorfold_prompt_store_host_hits",
                    "Kept states copied back from the host tier for a resume",
                    value=sharing.host_hits,
                )
        yield GaugeMetricFamily(
            "tensorfold_device_memory_peak_bytes",
            "Peak device memory (torch's peak on cuda, peak RSS on the cpu)",
            value=device_memory_peak(self.device),
        )


class Metrics:
    def __init__(self, engine: Engine, device: str, lanes: int) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, device, lanes))
        ProcessCollector(registry=self.registry)
        self.prompt_tokens = Counter(
            "tensorfold_prompt_tokens",
            "Prompt tokens, cached (from the prompt store) or computed",
            ["source"],
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "tensorfold_generation_tokens", "Tokens generated", registry=self.registry
        )
        self.requests = Counter(
            "tensorfold_requests",
            "Finished requests by endpoint and finish reason",
            ["endpoint", "reason"],
            registry=self.registry,
        )
        self.errors = Counter(
            "tensorfold_http_errors",
            "Error responses by status",
            ["status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "tensorfold_time_to_first_token_seconds",
            "From the request's arrival to its first token",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "tensorfold_time_between_tokens_seconds",
            "Between a stream's consecutive tokens",
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )

    def finished(self, endpoint: str, reason: str) -> None:
        """A request ended (its prompts' tokens are counted by `prompted`, its generated tokens
        as they are sampled, by the request's sink)."""
        self.requests.labels(endpoint, reason).inc()

    def prompted(self, prompt: int, cached: int) -> None:
        """A prompt's tokens, once a request's (each of a list's prompts) has ended."""
        self.prompt_tokens.labels("cached").inc(cached)
        self.prompt_tokens.labels("computed").inc(prompt - cached)

    def totals(self) -> dict[str, float]:
        """The server's counters and timing sums now (for the status page)."""
        return {
            "generation_tokens": _sum(self.generation_tokens),
            "requests": _sum(self.requests),
            "prompt_cached": _sum(self.prompt_tokens, source="cached"),
            "prompt_computed": _sum(self.prompt_tokens, source="computed"),
            "errors": _sum(self.errors),
            "ttft_sum": _sum(self.ttft, "_sum"),
            "ttft_count": _sum(self.ttft, "_count"),
            "itl_sum": _sum(self.itl, "_sum"),
            "itl_count": _sum(self.itl, "_count"),
        }

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _sum(metric: Counter | Histogram, suffix: str = "_total", **labels: str) -> float:
    """A metric's samples named *suffix (those with `labels`), added up over its labels."""
    return sum(
        s.value
        for family in metric.collect()
        for s in family.samples
        if s.name.endswith(suffix) and labels.items() <= s.labels.items()
    )
