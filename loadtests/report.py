"""Report: result files (JSON, one per run) and the text tables printed in the terminal.

A result is the dict `runner.run` returns. `write_result` stores it as `<name>.json`, where
`result_name` says label and sweep point (`ours-c16`, `vllm-r2`); `load_result` reads one back
and checks its format. `format_run` is the block printed after each run; `format_compare`
puts several results side by side, one column each (`run` prints it after a sweep, `compare`
for files from any runs). Plots live in plots.py.
"""

import json
from pathlib import Path

from loadtests.client import RequestRecord
from loadtests.runner import FORMAT

LAG_WARNING_MS = 10.0  # p99 client lag above this: the client may be the bottleneck
LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))
KEY_GAUGES = (("running", "vllm:num_requests_running", 1),
              ("waiting", "vllm:num_requests_waiting", 1),
              ("kv cache %", "vllm:kv_cache_usage_perc", 100))
KEY_COUNTERS = (("prompt tokens", "vllm:prompt_tokens"),
                ("generation tokens", "vllm:generation_tokens"))


def result_name(result: dict) -> str:
    arrival = result["config"]["arrival"]
    if arrival["mode"] == "closed":
        point = f"c{arrival['concurrency']}"
    else:
        point = f"r{float(arrival['rate']):g}"
        point += f"-b{arrival['burstiness']:g}" if arrival["burstiness"] != 1 else ""
    return f"{result['label']}-{point}"


def write_result(result: dict, out_dir) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result_name(result)}.json"
    path.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    return path


def load_result(path) -> dict:
    try:
        result = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"result file {str(path)!r} is not JSON: {e}") from None
    if not isinstance(result, dict) or result.get("format") != FORMAT:
        raise ValueError(f"result file {str(path)!r} is not a loadtests result ({FORMAT})")
    return result


def records_of(result: dict) -> list[RequestRecord]:
    return [RequestRecord(**r) for r in result["requests"]]


def describe_point(result: dict) -> str:
    arrival = result["config"]["arrival"]
    if arrival["mode"] == "closed":
        return f"concurrency {arrival['concurrency']} (closed loop)"
    bursty = f", burstiness {arrival['burstiness']:g}" if arrival["burstiness"] != 1 else ""
    return f"rate {float(arrival['rate']):g}/s (open loop{bursty})"


def format_run(result: dict) -> str:
    s = result["summary"]
    lines = [f"== {result['label']}: {describe_point(result)} ==",
             f"requests     {s['num_completed']} ok, {s['num_failed']} failed{_errors(s)}",
             f"duration     {s['duration_s']:.2f} s",
             f"throughput   {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} "
             f"output tok/s, {s['total_token_throughput']:.1f} total tok/s"]
    if "goodput" in s:
        g = s["goodput"]
        slos = ", ".join(f"{k}<={v:g} ms" for k, v in g["slos_ms"].items())
        lines.append(f"goodput      {g['request_rate']:.2f} req/s ({g['fraction']:.1%} within {slos})")
    lag = s["lag_ms"]
    lines.append(f"client lag   mean {_num(lag['mean'])} ms, p99 {_num(lag['p99'])} ms, "
                 f"max {_num(lag['max'])} ms")
    if lag["p99"] is not None and lag["p99"] > LAG_WARNING_MS:
        lines.append("WARNING      the client sent late; it, not the server, may limit this run")
    rows = [[name, *(_num(s[key][stat]) for stat in ("mean", "median", "p90", "p99"))]
            for name, key in LATENCIES]
    lines += table([["ms", "mean", "median", "p90", "p99"], *rows])
    return "\n".join(lines + _server_lines(result.get("server_metrics")))


def format_compare(results: list[dict]) -> str:
    """One column per result, one row per key metric."""
    rows = [["", *(result_name(r) for r in results)]]
    for name, get in _compare_rows(results):
        rows.append([name, *(_num(get(r)) for r in results)])
    return "\n".join(table(rows))


def table(rows: list[list[str]]) -> list[str]:
    """Lines of a text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                      for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]


def _compare_rows(results: list[dict]):
    summary = lambda *keys: lambda r: _dig(r["summary"], *keys)  # noqa: E731
    rows = [("completed", summary("num_completed")), ("failed", summary("num_failed")),
            ("duration s", summary("duration_s")), ("req/s", summary("request_throughput")),
            ("output tok/s", summary("output_throughput")),
            ("total tok/s", summary("total_token_throughput"))]
    if any("goodput" in r["summary"] for r in results):
        rows.append(("goodput req/s", summary("goodput", "request_rate")))
    for name, key in LATENCIES:
        rows += [(f"{name} {stat} ms", summary(key, stat)) for stat in ("mean", "median", "p99")]
    rows.append(("client lag p99 ms", summary("lag_ms", "p99")))
    if any(_dig(r, "server_metrics", "prefix_cache_hit_rate") is not None for r in results):
        rows.append(("prefix hit rate", lambda r: _dig(r, "server_metrics", "prefix_cache_hit_rate")))
    return rows


def _server_lines(report: dict | None) -> list[str]:
    if report is None:
        return ["server       no /metrics (not scraped, or the server exposes none)"]
    parts = [f"{name} mean {_num(g['mean'] * scale)} max {_num(g['max'] * scale)}"
             for name, key, scale in KEY_GAUGES if (g := report["gauges"].get(key))]
    parts += [f"{name} +{report['counter_deltas'][key]:.0f}"
              for name, key in KEY_COUNTERS if key in report["counter_deltas"]]
    if report["prefix_cache_hit_rate"] is not None:
        parts.append(f"prefix cache hit rate {report['prefix_cache_hit_rate']:.1%}")
    changed = sum(v != 0 for v in report["counter_deltas"].values())
    parts.append(f"{changed} counters changed (all in the JSON)")
    return ["server       " + "; ".join(parts)]


def _errors(summary: dict) -> str:
    errors = summary["errors_by_status"]
    return " (" + ", ".join(f"{k}: {v}" for k, v in errors.items()) + ")" if errors else ""


def _dig(d, *keys):
    for key in keys:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _num(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, int) or float(value).is_integer() and abs(value) >= 1000:
        return str(int(value))
    return f"{value:.2f}" if abs(value) < 100 else f"{value:.1f}"
