"""Arrival: when each request is sent. Closed loop at a fixed concurrency, or open loop at a rate.

`Arrival` says which (one point of a sweep); `Limit` says when to stop (request count and/or
duration, after a warm-up that is not counted). The two drivers call `send(index, scheduled_s)`
for request 0, 1, 2, ... and wait for all of them:
- `closed_loop`: `concurrency` workers; each sends its next request as soon as its previous one
  ends, so `scheduled_s` is the moment the worker became free;
- `open_loop`: request i is scheduled at `open_loop_times(...)[i]` whatever the server does; gaps
  are gamma-distributed with mean 1/rate and shape `burstiness` (1 = Poisson; smaller = burstier,
  coefficient of variation 1/sqrt(burstiness)); rate inf sends everything at once.
Times are seconds from the run's start, read from the `clock` the runner passes in.
The gap between `scheduled_s` and the actual send is the client's own lag, reported apart.
"""

import asyncio
import itertools
import math
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import numpy as np

Send = Callable[[int, float], Awaitable[None]]
Clock = Callable[[], float]


@dataclass(frozen=True)
class Arrival:
    concurrency: int | None = None  # closed loop
    rate: float | None = None  # open loop, requests/s (math.inf: all at once)
    burstiness: float = 1.0

    def __post_init__(self):
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency (closed loop) or rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency is not None else "open"

    @property
    def x(self) -> float:
        """The swept value: concurrency or rate."""
        return float(self.concurrency) if self.concurrency is not None else self.rate

    def describe(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        bursty = "" if self.burstiness == 1 else f", burstiness {self.burstiness:g}"
        return f"rate {self.rate:g}/s{bursty}"


@dataclass
class Limit:
    """Stop after `num_requests` counted requests or `duration_s` seconds of counted sending,
    whichever comes first; the first `num_warmup` requests come before and are not counted."""

    num_requests: int | None = None
    duration_s: float | None = None
    num_warmup: int = 0
    counted_start_s: float | None = None  # set when the first counted request is scheduled

    def __post_init__(self):
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give a request count, a duration, or both")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"number of requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration must be > 0 s, got {self.duration_s}")
        if self.num_warmup < 0:
            raise ValueError(f"number of warm-up requests must be >= 0, got {self.num_warmup}")

    @property
    def total(self) -> int | None:
        return None if self.num_requests is None else self.num_warmup + self.num_requests

    def is_open(self, index: int, scheduled_s: float) -> bool:
        """Whether request `index`, scheduled at `scheduled_s`, may still be sent."""
        if index < self.num_warmup:
            return True
        if self.total is not None and index >= self.total:
            return False
        if self.counted_start_s is None:
            self.counted_start_s = scheduled_s
        return self.duration_s is None or scheduled_s - self.counted_start_s < self.duration_s


def open_loop_times(rate: float, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """Endless scheduled times (s): 0, then cumulative gamma gaps of mean 1/rate."""
    rng = np.random.default_rng(seed)
    now = 0.0
    while True:
        if math.isinf(rate):
            yield 0.0
            continue
        for gap in rng.gamma(burstiness, 1.0 / (rate * burstiness), size=1024):
            yield now
            now += float(gap)


async def open_loop(send: Send, times: Iterator[float], limit: Limit, clock: Clock) -> None:
    tasks = []
    for index, scheduled_s in enumerate(times):
        if not limit.is_open(index, scheduled_s):
            break
        delay = scheduled_s - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(index, scheduled_s)))
    await asyncio.gather(*tasks)


async def closed_loop(send: Send, concurrency: int, limit: Limit, clock: Clock) -> None:
    indices = itertools.count()

    async def worker():
        ready_s = clock()
        while limit.is_open(index := next(indices), ready_s):
            await send(index, ready_s)
            ready_s = clock()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def drive(send: Send, arrival: Arrival, limit: Limit, clock: Clock, seed: int = 0) -> None:
    """Send requests as `arrival` says until `limit` closes."""
    if arrival.concurrency is not None:
        await closed_loop(send, arrival.concurrency, limit, clock)
    else:
        await open_loop(send, open_loop_times(arrival.rate, arrival.burstiness, seed), limit, clock)
