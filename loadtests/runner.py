"""Runner: one run (one sweep point) from a `RunSpec` and a workload to a result dict.

`run` opens one httpx.AsyncClient (no connection cap, so the pool never queues requests),
scrapes `/metrics`, then lets `arrival.drive` call `send` for request 0, 1, ...; `send` takes
prompt `index % len(prompts)` (a duration-limited run cycles the workload), fills a
`RequestRecord` through `client.send_request`, and ticks the progress bar. Afterwards it
scrapes again and builds the result: config, `metrics.summarize` summary, server metrics,
and every request's record. The result is plain JSON data (see report.py for the file).
"""

import asyncio
import dataclasses
import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from loadtests import prom
from loadtests.arrival import Arrival, Limit, drive
from loadtests.client import RequestRecord, Target, send_request
from loadtests.metrics import summarize
from loadtests.workloads import Prompt

FORMAT = "loadtests.result/1"
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RunSpec:
    target: Target
    arrival: Arrival
    num_requests: int | None = 100
    duration_s: float | None = None
    num_warmup: int = 0
    seed: int = 0
    slos: dict = field(default_factory=dict)
    label: str = "run"
    metrics_url: str | None = None  # None: do not scrape
    metrics_interval_s: float = 1.0  # 0: no polling during the run
    timeout_s: float = 600.0  # per read (the wait for the next chunk)
    is_progress: bool = True
    workload: dict = field(default_factory=dict)  # description, stored in the result

    def __post_init__(self):
        Limit(self.num_requests, self.duration_s, self.num_warmup)  # validates
        if self.arrival.rate == float("inf") and self.num_requests is None:
            raise ValueError("rate inf sends everything at once: it needs a request count")
        if self.metrics_interval_s < 0:
            raise ValueError(f"metrics interval must be >= 0 s, got {self.metrics_interval_s}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout must be > 0 s, got {self.timeout_s}")


def run(spec: RunSpec, prompts: list[Prompt], count_tokens: Callable[[str], int]) -> dict:
    """Run one sweep point to completion and return its result dict."""
    if not prompts:
        raise ValueError("the workload has no prompts")
    return asyncio.run(_run(spec, prompts, count_tokens))


async def _run(spec: RunSpec, prompts: list[Prompt], count_tokens) -> dict:
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    timeout = httpx.Timeout(spec.timeout_s, connect=CONNECT_TIMEOUT_S)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        before = await prom.scrape(http, spec.metrics_url) if spec.metrics_url else None
        stop, samples = asyncio.Event(), []
        poller = None
        if before is not None and spec.metrics_interval_s > 0:
            poller = asyncio.create_task(
                prom.poll(http, spec.metrics_url, spec.metrics_interval_s, stop, samples))
        records = await _send_all(spec, prompts, count_tokens, http)
        stop.set()
        if poller is not None:
            await poller
        after = await prom.scrape(http, spec.metrics_url) if before is not None else None
    records.sort(key=lambda r: r.index)
    return {"format": FORMAT, "label": spec.label, "started_at": started_at,
            "config": _config(spec), "summary": summarize(records, spec.slos),
            "server_metrics": prom.server_report(spec.metrics_url, before, after, samples),
            "requests": [_record_dict(r) for r in records]}


async def _send_all(spec: RunSpec, prompts: list[Prompt], count_tokens,
                    http: httpx.AsyncClient) -> list[RequestRecord]:
    limit = Limit(spec.num_requests, spec.duration_s, spec.num_warmup)
    records: list[RequestRecord] = []
    num_failed = [0]
    bar = tqdm(total=limit.total, desc=f"{spec.label}: {spec.arrival.describe()}", unit="req",
               disable=not spec.is_progress, leave=False)
    start = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - start

    async def send(index: int, scheduled_s: float) -> None:
        prompt = prompts[index % len(prompts)]
        record = RequestRecord(index, index < spec.num_warmup, prompt.num_prompt_tokens,
                               prompt.max_tokens, scheduled_s)
        records.append(record)
        await send_request(http, spec.target, prompt.text, record, clock, count_tokens)
        num_failed[0] += not record.is_ok
        bar.set_postfix(errors=num_failed[0], refresh=False)
        bar.update(1)

    try:
        await drive(send, spec.arrival, limit, clock, spec.seed)
    finally:
        bar.close()
    return records


def _config(spec: RunSpec) -> dict:
    target = {k: v for k, v in dataclasses.asdict(spec.target).items() if k != "api_key"}
    arrival = dataclasses.asdict(spec.arrival) | {"mode": spec.arrival.mode, "x": spec.arrival.x}
    arrival = {k: "inf" if v == float("inf") else v for k, v in arrival.items()}  # strict JSON
    return {"target": target, "arrival": arrival, "num_requests": spec.num_requests,
            "duration_s": spec.duration_s, "num_warmup": spec.num_warmup, "seed": spec.seed,
            "slos_ms": spec.slos, "metrics_url": spec.metrics_url, "workload": spec.workload}


def _record_dict(record: RequestRecord) -> dict:
    d = dataclasses.asdict(record)
    return {k: _round(v) for k, v in d.items()}


def _round(value):
    """Microsecond precision keeps result files small."""
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, list):
        return [_round(v) for v in value]
    return value
