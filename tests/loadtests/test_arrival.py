"""Arrival schedules: open-loop rate and burstiness statistics, limits, and the two drivers."""

import asyncio
import itertools
import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtests.arrival import Arrival, Limit, closed_loop, open_loop, open_loop_times

NUM_SAMPLES = 20000


def gaps(rate, burstiness, seed=0) -> np.ndarray:
    times = np.fromiter(itertools.islice(open_loop_times(rate, burstiness, seed), NUM_SAMPLES), float)
    return np.diff(times)


@pytest.mark.parametrize("rate, burstiness", [(5.0, 1.0), (50.0, 1.0), (5.0, 0.25), (20.0, 4.0)])
def test_open_loop_rate_and_burstiness(rate, burstiness):
    g = gaps(rate, burstiness)
    assert 1 / g.mean() == pytest.approx(rate, rel=0.05)
    # gamma with shape k has coefficient of variation 1/sqrt(k); Poisson (k=1) has 1
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_open_loop_is_seeded():
    assert np.array_equal(gaps(3.0, 0.5, seed=7), gaps(3.0, 0.5, seed=7))
    assert not np.array_equal(gaps(3.0, 0.5, seed=7), gaps(3.0, 0.5, seed=8))


def test_infinite_rate_sends_all_at_once():
    assert list(itertools.islice(open_loop_times(math.inf), 5)) == [0.0] * 5


@given(rate=st.floats(0.01, 1e4), burstiness=st.floats(0.05, 20), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=30, deadline=None)
def test_open_loop_times_start_at_zero_and_never_decrease(rate, burstiness, seed):
    times = list(itertools.islice(open_loop_times(rate, burstiness, seed), 50))
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))


def test_limit_by_count_with_warmup():
    limit = Limit(num_requests=3, num_warmup=2)
    assert [limit.is_open(i, 0.0) for i in range(6)] == [True] * 5 + [False]
    assert limit.total == 5


def test_limit_by_duration_starts_at_the_first_counted_request():
    limit = Limit(duration_s=1.0, num_warmup=1)
    assert limit.is_open(0, 5.0)  # warm-up, any time
    assert limit.is_open(1, 10.0) and limit.is_open(2, 10.9)
    assert not limit.is_open(3, 11.0)
    assert Limit(num_requests=2, duration_s=100).is_open(2, 0.0) is False


@pytest.mark.parametrize("kwargs", [dict(), dict(concurrency=1, rate=1.0), dict(concurrency=0),
                                    dict(rate=0.0), dict(rate=-1.0), dict(rate=1.0, burstiness=0)])
def test_bad_arrivals_are_refused(kwargs):
    with pytest.raises(ValueError):
        Arrival(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(), dict(num_requests=0), dict(duration_s=0.0),
                                    dict(num_requests=1, num_warmup=-1)])
def test_bad_limits_are_refused(kwargs):
    with pytest.raises(ValueError):
        Limit(**kwargs)


def test_closed_loop_keeps_exactly_concurrency_in_flight():
    in_flight, peak, sent = [0], [0], []

    async def send(index, scheduled_s):
        sent.append(index)
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        await asyncio.sleep(0.002)
        in_flight[0] -= 1

    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731
    asyncio.run(closed_loop(send, 4, Limit(num_requests=20, num_warmup=2), clock))
    assert sorted(sent) == list(range(22)) and peak[0] == 4


def test_open_loop_sends_on_schedule():
    scheduled, lags = [], []
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731

    async def send(index, scheduled_s):
        scheduled.append(scheduled_s)
        lags.append(clock() - scheduled_s)
        await asyncio.sleep(0.05)  # slower than the gaps: open loop does not wait for it

    times = iter([0.0, 0.01, 0.02, 0.03, 0.2, 0.21])
    asyncio.run(open_loop(send, times, Limit(num_requests=5), clock))
    assert scheduled == [0.0, 0.01, 0.02, 0.03, 0.2]
    assert max(lags) < 0.02 and clock() < 0.3
