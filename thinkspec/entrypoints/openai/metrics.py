"""Prometheus metrics of one server (one CollectorRegistry per app, so apps do not share series).

Exposed names (prometheus_client appends `_total` to counters):

- thinkspec:request_success_total{finished_reason}   requests finished: stop, length, abort, error
- thinkspec:prompt_tokens_total / thinkspec:generation_tokens_total
- thinkspec:num_requests_running / thinkspec:num_requests_waiting   (gauges)
- thinkspec:kv_blocks_used / thinkspec:kv_blocks_free                (gauges)
- thinkspec:num_preemptions_total
- thinkspec:kv_cache_usage_perc                                       (gauge, fraction 0 to 1)
- thinkspec:prefix_cache_queries_total / thinkspec:prefix_cache_hits_total   (prompt tokens)
- thinkspec:time_to_first_token_seconds, thinkspec:inter_token_latency_seconds,
  thinkspec:e2e_request_latency_seconds                               (histograms)
- thinkspec:engine_healthy                                            (gauge, 1 or 0)
- thinkspec:spec_decode_num_drafts_total{phase}
- thinkspec:spec_decode_num_draft_tokens_total{phase}
- thinkspec:spec_decode_num_accepted_tokens_total{phase}
- thinkspec:spec_decode_num_accepted_tokens_per_pos_total{phase,position}
- thinkspec:spec_decode_num_relaxed_accepted_tokens_total{phase}
- thinkspec:spec_decode_draft_length{phase}   histogram of the draft length chosen per decode row
  and step (adaptive_k; buckets le = 0..K, 0 = a plain row): _bucket{le}, _count, _sum

phase is "thinking" or "answer". Engine-side values are read from the snapshot the engine thread
takes after every step, so a scrape never touches the engine.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from thinkspec.entrypoints.async_engine import AsyncLLMEngine
from thinkspec.outputs import RequestOutput
from thinkspec.spec_decode.metrics import PHASES, SpecDecodeMetrics

_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip

_SPEC_COUNTERS = (
    ("num_drafts", "verify steps with at least one draft token"),
    ("num_draft_tokens", "draft tokens proposed"),
    ("num_accepted_tokens", "draft tokens accepted"),
    ("num_relaxed_accepted_tokens", "draft tokens accepted only because of relaxed acceptance"),
)


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats
        for name, doc, value in (
            ("num_requests_running", "requests in the running batch", stats.num_running),
            ("num_requests_waiting", "requests waiting to be scheduled", stats.num_waiting),
            ("kv_blocks_used", "KV-cache blocks held by requests", stats.num_kv_blocks_used),
            ("kv_blocks_free", "KV-cache blocks free (cached prefixes included)", stats.num_kv_blocks_free),
            (
                "engine_healthy",
                "1 while the engine loop runs, 0 after it failed",
                int(self.engine.is_healthy),
            ),
        ):
            yield GaugeMetricFamily(f"thinkspec:{name}", doc, value=value)
        blocks = stats.num_kv_blocks_used + stats.num_kv_blocks_free
        usage = stats.num_kv_blocks_used / blocks if blocks else 0.0
        yield GaugeMetricFamily(
            "thinkspec:kv_cache_usage_perc", "fraction of KV-cache blocks in use", value=usage
        )
        yield CounterMetricFamily(
            "thinkspec:num_preemptions", "requests preempted (recomputed later)", value=stats.num_preemptions
        )
        for name, doc, value in (
            (
                "prefix_cache_queries",
                "prompt tokens looked up in the prefix cache",
                stats.prefix_cache_queries,
            ),
            ("prefix_cache_hits", "prompt tokens found in the prefix cache", stats.prefix_cache_hits),
        ):
            yield CounterMetricFamily(f"thinkspec:{name}", doc, value=value)

        spec = stats.spec_metrics
        for key, doc in _SPEC_COUNTERS:
            family = CounterMetricFamily(f"thinkspec:spec_decode_{key}", doc, labels=["phase"])
            for phase in PHASES:
                family.add_metric([phase], 0 if spec is None else getattr(spec.phase(phase), key))
            yield family
        per_pos = CounterMetricFamily(
            "thinkspec:spec_decode_num_accepted_tokens_per_pos",
            "draft tokens accepted at each draft position",
            labels=["phase", "position"],
        )
        if spec is not None:
            for phase in PHASES:
                for pos, count in enumerate(spec.phase(phase).num_accepted_tokens_per_pos):
                    per_pos.add_metric([phase, str(pos)], count)
        yield per_pos
        yield _draft_length_histogram(spec)


def _draft_length_histogram(spec: SpecDecodeMetrics | None) -> HistogramMetricFamily:
    """Prometheus histogram of the chosen draft lengths per phase (cumulative buckets le = 0..K)."""
    family = HistogramMetricFamily(
        "thinkspec:spec_decode_draft_length",
        "draft length chosen for each decode row and step (adaptive_k; 0 = a plain decode row)",
        labels=["phase"],
    )
    for phase in PHASES if spec is not None else ():
        counts = spec.phase(phase).draft_length_histogram
        if not counts:
            continue
        cumulative = np.cumsum(counts).tolist()
        buckets = [(str(k), c) for k, c in enumerate(cumulative)] + [("+Inf", cumulative[-1])]
        family.add_metric([phase], buckets, sum_value=float(np.dot(np.arange(len(counts)), counts)))
    return family


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.registry = CollectorRegistry()
        self.request_success = Counter(
            "thinkspec:request_success",
            "finished requests by finish reason",
            ["finished_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "thinkspec:prompt_tokens", "prompt tokens processed", registry=self.registry
        )
        self.generation_tokens = Counter(
            "thinkspec:generation_tokens", "tokens generated", registry=self.registry
        )
        # vLLM's buckets for these three histograms.
        self.ttft = Histogram(
            "thinkspec:time_to_first_token_seconds",
            "seconds from arrival to the first output token",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "thinkspec:inter_token_latency_seconds",
            "seconds between consecutive outputs of a request (one per engine step that added tokens)",
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "thinkspec:e2e_request_latency_seconds",
            "seconds from arrival to the end of a request",
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine))

    def observe_finished(self, out: RequestOutput, token_gaps: Sequence[float] = ()) -> None:
        """Count one request that ended (its last output; aborted requests included), with its
        latencies: token_gaps are the seconds between its outputs."""
        self.request_success.labels(out.outputs[0].finish_reason or "abort").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))  # all n choices
        for gap in token_gaps:
            self.itl.observe(gap)
        if out.metrics is None:
            return
        if out.metrics.time_to_first_token is not None:
            self.ttft.observe(out.metrics.time_to_first_token)
        if out.finished and out.metrics.e2e_latency is not None:
            self.e2e.observe(out.metrics.e2e_latency)

    def observe_aborted_early(self) -> None:
        """Count one request aborted before the engine produced any output for it."""
        self.request_success.labels("abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
