"""Metrics: pure functions from `RequestRecord` timelines to one run's summary dict.

Per request (all from the moment the request was sent, so the client's own lag is not in them):
- TTFT: first content chunk - sent;  E2E: end of stream - sent;
- TPOT: (last content chunk - first content chunk) / (output tokens - 1), for >= 2 tokens;
- ITL: every gap between consecutive content chunks (one chunk may carry several tokens);
- lag: sent - scheduled, the client's scheduling delay (large = the client is the bottleneck).
Distributions report mean, median, p90, p99, min, max, std in milliseconds (numpy percentiles,
linear interpolation). Throughputs divide by the run's window: the earliest scheduled time to
the latest end among counted requests. Warm-up requests are left out of everything. Goodput is
the rate of successful requests that meet every SLO given (ttft, tpot, itl, e2e in ms; itl is
checked against the request's largest gap).
"""

import numpy as np

from loadtests.client import RequestRecord

PERCENTILES = {"median": 50, "p90": 90, "p99": 99}
SLO_NAMES = ("ttft", "tpot", "itl", "e2e")


def parse_slos(specs: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for spec in specs:
        name, _, value = spec.partition(":")
        if name not in SLO_NAMES:
            raise ValueError(f"SLO {spec!r}: name must be one of {SLO_NAMES}, as NAME:MS")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"SLO {spec!r}: {value!r} is not a number of milliseconds") from None
        if not slos[name] > 0:
            raise ValueError(f"SLO {spec!r}: milliseconds must be > 0")
    return slos


def distribution(values_ms) -> dict:
    """mean, median, p90, p99, min, max, std and count of a list of milliseconds."""
    values = np.asarray(values_ms, dtype=float)
    if values.size == 0:
        return {"count": 0, "mean": None, **dict.fromkeys(PERCENTILES), "min": None,
                "max": None, "std": None}
    stats = {"count": int(values.size), "mean": float(values.mean())}
    stats |= {name: float(np.percentile(values, q)) for name, q in PERCENTILES.items()}
    return stats | {"min": float(values.min()), "max": float(values.max()),
                    "std": float(values.std())}


def ttft_ms(r: RequestRecord) -> float:
    return (r.first_token_s - r.sent_s) * 1e3


def e2e_ms(r: RequestRecord) -> float:
    return (r.end_s - r.sent_s) * 1e3


def tpot_ms(r: RequestRecord) -> float | None:
    if r.num_output_tokens < 2:
        return None
    return (r.chunk_s[-1] - r.first_token_s) * 1e3 / (r.num_output_tokens - 1)


def itls_ms(r: RequestRecord) -> list[float]:
    return (np.diff(r.chunk_s) * 1e3).tolist()


def lag_ms(r: RequestRecord) -> float:
    return (r.sent_s - r.scheduled_s) * 1e3


def meets_slos(r: RequestRecord, slos: dict[str, float]) -> bool:
    if not r.is_ok:
        return False
    itls = itls_ms(r)
    measured = {"ttft": ttft_ms(r), "tpot": tpot_ms(r) or 0.0, "e2e": e2e_ms(r),
                "itl": max(itls) if itls else 0.0}
    return all(measured[name] <= limit for name, limit in slos.items())


def errors_by_status(records: list[RequestRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        if not r.is_ok:
            counts[r.error_kind] = counts.get(r.error_kind, 0) + 1
    return dict(sorted(counts.items()))


def window_s(records: list[RequestRecord]) -> float:
    """From the earliest scheduled time to the latest end of the given requests."""
    ended = [r.end_s for r in records if r.end_s is not None]
    if not ended:
        return 0.0
    return max(ended) - min(r.scheduled_s for r in records)


def summarize(records: list[RequestRecord], slos: dict[str, float] | None = None) -> dict:
    """The summary of one run; warm-up records are dropped first."""
    counted = [r for r in records if not r.is_warmup]
    ok = [r for r in counted if r.is_ok]
    duration = window_s(counted)
    num_input = sum(_prompt_tokens(r) for r in ok)
    num_output = sum(r.num_output_tokens for r in ok)
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    summary = {
        "num_requests": len(counted), "num_completed": len(ok), "num_failed": len(counted) - len(ok),
        "errors_by_status": errors_by_status(counted), "duration_s": duration,
        "num_input_tokens": num_input, "num_output_tokens": num_output,
        "request_throughput": per_s(len(ok)), "output_throughput": per_s(num_output),
        "total_token_throughput": per_s(num_input + num_output),
        "ttft_ms": distribution([ttft_ms(r) for r in ok]),
        "tpot_ms": distribution([t for r in ok if (t := tpot_ms(r)) is not None]),
        "itl_ms": distribution([gap for r in ok for gap in itls_ms(r)]),
        "e2e_ms": distribution([e2e_ms(r) for r in ok]),
        "lag_ms": distribution([lag_ms(r) for r in counted if r.sent_s is not None]),
    }
    if slos:
        num_good = sum(meets_slos(r, slos) for r in ok)
        summary["goodput"] = {"slos_ms": slos, "num_good": num_good, "request_rate": per_s(num_good),
                              "fraction": num_good / len(counted) if counted else 0.0}
    return summary


def _prompt_tokens(r: RequestRecord) -> int:
    """The server's prompt count when it reported one (it includes any chat template)."""
    return r.num_server_prompt_tokens if r.num_server_prompt_tokens is not None else r.num_prompt_tokens
