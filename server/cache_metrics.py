"""`/metrics` of the caches: the prompt-embedding cache (`--prompt-cache-mb`), counted by the
workers and added up at each scrape, and the HTTP server's result cache (`--result-cache-mb`)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.core.service import EngineService
from server.result_cache import ResultCache


class PromptCacheCollector(Collector):
    """The prompt-embedding cache (`--prompt-cache-mb`), added up over the workers: texts
    served from it and texts encoded, entries evicted, seconds in the text encoders, and
    its size now. Nothing without one."""

    _COUNTERS = (
        ("hits", "texts (prompts and negative prompts, one per image) served from the prompt cache"),
        ("misses", "texts that went through the text encoders"),
        ("evictions", "prompt cache entries evicted to stay within --prompt-cache-mb"),
        ("encode_seconds", "seconds in the text encoders (host time) for the texts that missed"),
    )

    def __init__(self, engine: EngineService) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        counts = self.engine.prompt_cache
        if not counts:
            return
        for name, text in self._COUNTERS:
            yield CounterMetricFamily(f"diffbatch_prompt_cache_{name}", text, value=counts.get(name, 0.0))
        yield GaugeMetricFamily(
            "diffbatch_prompt_cache_bytes", "bytes the prompt cache holds", value=counts.get("bytes", 0.0)
        )
        yield GaugeMetricFamily(
            "diffbatch_prompt_cache_entries", "texts the prompt cache holds", value=counts.get("entries", 0.0)
        )


class ResultCacheCollector(Collector):
    """The result cache (`--result-cache-mb`): requests with a seed answered from it or not,
    entries evicted, and its size now."""

    def __init__(self, cache: ResultCache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        cache = self.cache
        for name, value, text in (
            ("hits", cache.hits, "requests with a seed answered from the result cache"),
            ("misses", cache.misses, "requests with a seed that ran (not in the result cache)"),
            ("evictions", cache.evictions, "result cache entries evicted to stay within --result-cache-mb"),
        ):
            yield CounterMetricFamily(f"diffbatch_result_cache_{name}", text, value=value)
        yield GaugeMetricFamily(
            "diffbatch_result_cache_bytes", "encoded image bytes the result cache holds", value=cache.nbytes
        )
        yield GaugeMetricFamily(
            "diffbatch_result_cache_entries", "answers the result cache holds", value=len(cache)
        )
