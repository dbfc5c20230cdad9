"""Prometheus scraping: parsing vLLM-style pages, deltas, and servers without /metrics."""

import asyncio

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from loadtests.prom import parse, scrape, server_report


def page(queries: float, hits: float, running: float) -> str:
    registry = CollectorRegistry()
    q = Counter("vllm:prefix_cache_queries", "q", ["model_name"], registry=registry)
    q.labels("a").inc(queries / 2)
    q.labels("b").inc(queries / 2)  # label sets are summed
    Counter("vllm:prefix_cache_hits", "h", registry=registry).inc(hits)
    Gauge("vllm:num_requests_running", "r", registry=registry).set(running)
    Histogram("vllm:e2e_request_latency_seconds", "e", registry=registry).observe(queries / 100)
    return generate_latest(registry).decode()


def test_parse_splits_counters_and_gauges():
    snapshot = parse(page(100, 40, 3))
    assert snapshot.counters["vllm:prefix_cache_queries"] == 100
    assert snapshot.counters["vllm:prefix_cache_hits"] == 40
    assert snapshot.counters["vllm:e2e_request_latency_seconds_count"] == 1
    assert snapshot.gauges == {"vllm:num_requests_running": 3}  # no _created, no _bucket
    untyped = parse("foo_total 3\nbar 2\nbaz_count 1\n")
    assert untyped.counters == {"foo": 3, "baz_count": 1} and untyped.gauges == {"bar": 2}


def test_server_report_has_deltas_gauge_stats_and_hit_rate():
    before, after = parse(page(100, 40, 0)), parse(page(300, 140, 1))
    report = server_report("u", before, after, [{"vllm:num_requests_running": 4},
                                                {"vllm:num_requests_running": 8}])
    assert report["counter_deltas"]["vllm:prefix_cache_queries"] == 200
    assert report["prefix_cache_hit_rate"] == pytest.approx(100 / 200)
    running = report["gauges"]["vllm:num_requests_running"]
    assert running == {"before": 0, "after": 1, "mean": 6, "max": 8}
    assert server_report("u", None, after, []) is None


def test_scrape_handles_servers_without_metrics():
    def handler(request):
        if request.url.path == "/ok":
            return httpx.Response(200, text=page(1, 1, 1))
        if request.url.path == "/garbage":
            return httpx.Response(200, text="<html>{{not prometheus")
        return httpx.Response(404, text="not found")

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return [await scrape(http, f"http://s{path}") for path in ("/ok", "/garbage", "/missing")]

    ok, garbage, missing = asyncio.run(go())
    assert ok.gauges["vllm:num_requests_running"] == 1
    assert garbage is None and missing is None
