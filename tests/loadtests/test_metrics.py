"""Metric computation against hand-built request timelines (times in seconds)."""

import pytest

from loadtests.client import RequestRecord
from loadtests.metrics import distribution, parse_slos, summarize


def record(index, scheduled, sent, chunks, end, num_tokens, **kw) -> RequestRecord:
    return RequestRecord(index=index, is_warmup=kw.pop("is_warmup", False), num_prompt_tokens=20,
                         max_tokens=num_tokens, scheduled_s=scheduled, sent_s=sent,
                         first_token_s=chunks[0] if chunks else None, end_s=end, chunk_s=chunks,
                         num_output_tokens=num_tokens, **kw)


def timeline() -> list[RequestRecord]:
    return [
        # TTFT 100 ms, then 3 gaps of 10 ms; e2e 139 ms; sent 1 ms late; server says 10 prompt tokens
        record(0, 0.0, 0.001, [0.101, 0.111, 0.121, 0.131], 0.140, 4, num_server_prompt_tokens=10),
        # TTFT 200 ms, one gap of 40 ms; e2e 250 ms
        record(1, 0.5, 0.5, [0.7, 0.74], 0.75, 2),
        record(2, 0.6, 0.6, [], 0.61, 0, status=429, error_kind="429", error="too many"),
        # warm-up: ignored everywhere, even though it is the slowest and earliest
        record(3, -1.0, -1.0, [1.0, 2.0], 3.0, 2, is_warmup=True),
        # one token: has TTFT and e2e but no TPOT and no ITL
        record(4, 0.6, 0.6, [0.65], 0.7, 1),
    ]


def test_latencies_per_request():
    s = summarize(timeline())
    assert s["ttft_ms"]["count"] == 3
    assert s["ttft_ms"]["mean"] == pytest.approx((100 + 200 + 50) / 3)
    assert s["ttft_ms"]["median"] == pytest.approx(100)
    assert s["ttft_ms"]["p99"] == pytest.approx(100 + 0.98 * 100)  # numpy linear interpolation
    assert s["tpot_ms"]["mean"] == pytest.approx((10 + 40) / 2)
    assert s["itl_ms"]["count"] == 4
    assert s["itl_ms"]["median"] == pytest.approx(10)
    assert s["itl_ms"]["mean"] == pytest.approx(17.5)
    assert s["itl_ms"]["max"] == pytest.approx(40)
    assert s["e2e_ms"]["median"] == pytest.approx(139)
    assert s["e2e_ms"]["max"] == pytest.approx(250)


def test_counts_errors_and_lag():
    s = summarize(timeline())
    assert (s["num_requests"], s["num_completed"], s["num_failed"]) == (4, 3, 1)
    assert s["errors_by_status"] == {"429": 1}
    assert s["lag_ms"]["max"] == pytest.approx(1.0)
    assert s["lag_ms"]["count"] == 4  # failed requests were sent too


def test_throughput_over_the_window():
    s = summarize(timeline())
    assert s["duration_s"] == pytest.approx(0.75)  # earliest counted schedule 0.0 to last end
    assert s["request_throughput"] == pytest.approx(3 / 0.75)
    assert s["num_output_tokens"] == 4 + 2 + 1
    assert s["output_throughput"] == pytest.approx(7 / 0.75)
    assert s["num_input_tokens"] == 10 + 20 + 20  # server's count preferred when given
    assert s["total_token_throughput"] == pytest.approx(57 / 0.75)


def test_goodput_counts_requests_meeting_every_slo():
    s = summarize(timeline(), parse_slos(["ttft:150", "tpot:20"]))
    # request 0 (100 ms, 10 ms) and 4 (50 ms, no TPOT) pass; 1 misses TTFT; 2 failed
    assert s["goodput"]["num_good"] == 2
    assert s["goodput"]["request_rate"] == pytest.approx(2 / 0.75)
    assert s["goodput"]["fraction"] == pytest.approx(2 / 4)
    assert summarize(timeline(), {"itl": 20})["goodput"]["num_good"] == 2  # request 1 has a 40 ms gap
    assert "goodput" not in summarize(timeline())


def test_empty_and_all_failed_runs():
    failed = [record(0, 0.0, 0.0, [], 0.1, 0, error_kind="connection")]
    s = summarize(failed)
    assert s["num_completed"] == 0 and s["request_throughput"] == 0.0
    assert s["ttft_ms"]["mean"] is None and s["ttft_ms"]["count"] == 0
    assert summarize([])["duration_s"] == 0.0
    assert distribution([5.0])["p99"] == 5.0


@pytest.mark.parametrize("spec", ["ttft", "ttft:", "ttft:abc", "foo:10", "tpot:-1", "e2e:0"])
def test_bad_slos_name_the_value(spec):
    with pytest.raises(ValueError, match="SLO"):
        parse_slos([spec])
