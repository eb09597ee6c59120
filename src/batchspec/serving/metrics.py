"""/metrics: the online engine's counters in Prometheus' text format, read at scrape time.

A custom collector (no global registry, no metric objects updated from the engine thread): the
engine keeps plain totals (online.Counters, step.Stats) and this module only reads them.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class EngineCollector:
    """Yields the server's metrics from a server.Service (engine counters and refusals)."""

    def __init__(self, service):
        self.service = service

    def collect(self):
        engine = self.service.engine
        counters, stats = engine.counters, engine.ctx.stats
        requests = CounterMetricFamily(
            "batchspec_requests",
            "Requests by outcome (stop, length, abort, error; refused: invalid, queue_full)",
            labels=["outcome"],
        )
        for outcome, n in sorted({**counters.outcomes, **self.service.rejected}.items()):
            requests.add_metric([outcome], n)
        yield requests
        yield _counter("batchspec_prompt_tokens", "Prompt tokens of admitted requests", counters.prompt_tokens)
        yield _counter("batchspec_generation_tokens", "Generated tokens handed to requests", counters.generated_tokens)
        yield _counter("batchspec_draft_tokens_proposed", "Draft tokens proposed", stats.proposed_drafts)
        yield _counter("batchspec_draft_tokens_accepted", "Draft tokens accepted", _accepted(stats))
        yield _counter("batchspec_decode_steps", "Decode steps of the whole batch", stats.steps)
        stages = CounterMetricFamily(
            "batchspec_stage_seconds", "Engine seconds by stage (prefill, draft, verify, ...)", labels=["stage"]
        )
        for stage, seconds in sorted(dict(stats.stage_s).items()):  # a copy: the engine thread writes it
            stages.add_metric([stage], seconds)
        yield stages
        mean = stats.step_tokens / stats.row_steps if stats.row_steps else 0.0
        yield _gauge("batchspec_mean_tokens_per_step", "Tokens per row per decode step, mean since start", mean)
        yield _gauge("batchspec_queue_length", "Requests waiting for a row", counters.queue_length)
        yield _gauge("batchspec_running_rows", "Rows decoding", counters.running)
        yield _gauge(
            "batchspec_kv_slots_used", "Target KV slots holding entries of running rows", counters.kv_slots_used
        )
        yield _gauge(
            "batchspec_kv_slots_allocated",
            "Target KV slots allocated (size-class slabs; freed as rows leave)",
            counters.kv_slots_allocated,
        )
        yield _gauge(
            "batchspec_kv_bytes", "KV bytes allocated: every model's slabs and the prefix cache", counters.kv_bytes
        )
        peak = counters.kv_bytes_peak
        yield _gauge("batchspec_kv_bytes_peak", "The most KV bytes allocated at once since start", peak)
        yield _gauge("batchspec_kv_slots_total", "Target KV tokens the budget allows across all rows", engine.budget)
        if engine.prefixes is not None:
            prefixes = engine.prefixes.summary()
            yield _counter(
                "batchspec_prefix_cache_lookups", "Admitted prompts looked up in the prefix cache", prefixes["lookups"]
            )
            yield _counter(
                "batchspec_prefix_cache_hits", "Admitted prompts that began with a cached prefix", prefixes["hits"]
            )
            yield _counter(
                "batchspec_prefix_cache_reused_tokens",
                "Prompt tokens not prefilled: taken from the prefix cache",
                prefixes["reused_tokens"],
            )
            yield _gauge(
                "batchspec_prefix_cache_held_tokens",
                "Target KV entries the prefix cache holds",
                prefixes["held_tokens"],
            )


def _accepted(stats) -> int:
    return sum(n * count for n, count in stats.accepted_hist.items())


def _counter(name: str, doc: str, value) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
