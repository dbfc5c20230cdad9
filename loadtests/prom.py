"""Server metrics: scrape a Prometheus `/metrics` page and report what changed over a run.

`scrape` fetches and parses the text format (with prometheus_client's parser) into a
`Snapshot`: counters (counter `_total` values with the suffix dropped, histogram/summary `_sum`
and `_count`) and gauges, each summed over its label sets. The runner scrapes before and after
the run and `poll`s the gauges while it runs; `server_report` turns that into counter deltas,
gauge before/after/mean/max, and the prefix-cache hit rate when the server counts
`vllm:prefix_cache_queries` and `vllm:prefix_cache_hits`. A server without `/metrics` (any
HTTP error, network error or unparsable page) gives `None`, never an exception.
"""

import asyncio
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

COUNTER_TYPES = ("counter", "histogram", "summary", "gaugehistogram")
COUNTER_SUFFIXES = ("_total", "_sum", "_count")
SKIPPED_SUFFIXES = ("_bucket", "_created", "_gcount", "_gsum")
PREFIX_QUERIES, PREFIX_HITS = "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"
KEY_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


@dataclass
class Snapshot:
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)


def parse(text: str) -> Snapshot:
    """Parse Prometheus text; raises ValueError when it is not the text format."""
    snapshot = Snapshot()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(SKIPPED_SUFFIXES):
                continue
            is_counter = family.type in COUNTER_TYPES or (
                family.type == "unknown" and sample.name.endswith(COUNTER_SUFFIXES))
            if is_counter:
                name = sample.name.removesuffix("_total")
                snapshot.counters[name] = snapshot.counters.get(name, 0.0) + sample.value
            else:
                snapshot.gauges[sample.name] = snapshot.gauges.get(sample.name, 0.0) + sample.value
    return snapshot


async def scrape(http: httpx.AsyncClient, url: str) -> Snapshot | None:
    try:
        response = await http.get(url)
        response.raise_for_status()
        return parse(response.text)
    except (httpx.HTTPError, ValueError, TypeError):
        return None


async def poll(http: httpx.AsyncClient, url: str, interval_s: float, stop: asyncio.Event,
               samples: list[dict[str, float]]) -> None:
    """Append the gauges every `interval_s` until `stop` is set (or the server has none)."""
    while not stop.is_set():
        snapshot = await scrape(http, url)
        if snapshot is None:
            return
        samples.append(snapshot.gauges)
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except TimeoutError:
            pass


def server_report(url: str, before: Snapshot | None, after: Snapshot | None,
                  samples: list[dict[str, float]]) -> dict | None:
    """Counter deltas, gauge statistics and the prefix-cache hit rate; None without metrics."""
    if before is None or after is None:
        return None
    deltas = {name: after.counters[name] - before.counters.get(name, 0.0)
              for name in sorted(after.counters)}
    gauges = {name: _gauge_stats(name, before, after, samples) for name in sorted(after.gauges)}
    queries, hits = deltas.get(PREFIX_QUERIES), deltas.get(PREFIX_HITS)
    hit_rate = hits / queries if queries and hits is not None else None
    return {"url": url, "counter_deltas": deltas, "gauges": gauges,
            "prefix_cache_hit_rate": hit_rate, "num_samples": len(samples)}


def _gauge_stats(name: str, before: Snapshot, after: Snapshot,
                 samples: list[dict[str, float]]) -> dict:
    values = [s[name] for s in samples if name in s] or [after.gauges[name]]
    return {"before": before.gauges.get(name), "after": after.gauges[name],
            "mean": sum(values) / len(values), "max": max(values)}
