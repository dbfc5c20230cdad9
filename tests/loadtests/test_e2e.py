"""End to end: the command line against a fake server that streams at a known pace."""

import json
import socket

import httpx
import pytest

from loadtests.cli import main
from loadtests.workloads import count_tokens, load_tokenizer
from tests.loadtests.fake_server import CHUNK_TEXT, FakeServer, Pace

TTFT_S, ITL_S, OUTPUT_LEN = 0.08, 0.02, 6


def run(url, tokenizer_dir, out_dir, *extra) -> int:
    return main(["run", "--base-url", url, "--model", "fake", "--tokenizer", str(tokenizer_dir),
                 "--input-len", "24", "--output-len", str(OUTPUT_LEN), "--out-dir", str(out_dir),
                 "--no-progress", "--metrics-interval", "0.05", *extra])


def load(path) -> dict:
    return json.loads(path.read_text())


def assert_pace(summary: dict, is_one_token_per_chunk: bool = True) -> None:
    """The tool reports the fake server's pace back (medians; this machine is shared)."""
    assert TTFT_S * 1e3 <= summary["ttft_ms"]["median"] <= TTFT_S * 1e3 * 1.25 + 5
    assert summary["itl_ms"]["median"] == pytest.approx(ITL_S * 1e3, rel=0.2)
    if is_one_token_per_chunk:
        assert summary["tpot_ms"]["median"] == pytest.approx(ITL_S * 1e3, rel=0.2)
    e2e_ms = (TTFT_S + (OUTPUT_LEN - 1) * ITL_S) * 1e3
    assert e2e_ms <= summary["e2e_ms"]["median"] <= e2e_ms * 1.25 + 5


def test_closed_loop_sweep_reports_the_pace(tiny_model_dir, tmp_path, capsys):
    with FakeServer(Pace(TTFT_S, ITL_S)) as server:
        assert run(server.url + "/v1", tiny_model_dir, tmp_path, "--concurrency", "1,4",
                   "--num-requests", "12", "--warmup-requests", "2", "--no-plots") == 0
    for name in ("run-c1", "run-c4"):
        result = load(tmp_path / f"{name}.json")
        s = result["summary"]
        assert (s["num_requests"], s["num_completed"], s["errors_by_status"]) == (12, 12, {})
        assert s["num_output_tokens"] == 12 * OUTPUT_LEN
        assert_pace(s)
        assert s["lag_ms"]["p99"] < 20
        requests = result["requests"]
        assert [r["index"] for r in requests] == list(range(14))
        assert [r["is_warmup"] for r in requests] == [True] * 2 + [False] * 12
        assert {r["num_prompt_tokens"] for r in requests} == {24}
        assert all(len(r["chunk_s"]) == OUTPUT_LEN and r["output_tokens_source"] == "usage"
                   for r in requests)
        deltas = result["server_metrics"]["counter_deltas"]
        assert deltas["vllm:generation_tokens"] == 14 * OUTPUT_LEN  # warm-up runs on the server too
    assert result["server_metrics"]["gauges"]["vllm:num_requests_running"]["max"] <= 4
    out = capsys.readouterr().out
    assert "run-c1" in out and "run-c4" in out and "TTFT" in out


def test_chat_open_loop_counts_rejections_by_status(tiny_model_dir, tmp_path, capsys):
    with FakeServer(Pace(TTFT_S, ITL_S, reject_every=4)) as server:
        assert run(server.url, tiny_model_dir, tmp_path, "--endpoint", "chat", "--rate", "40",
                   "--num-requests", "20", "--slo", "ttft:500", "--label", "chat") == 0
    result = load(tmp_path / "chat-r40.json")
    s = result["summary"]
    assert (s["num_requests"], s["num_completed"], s["num_failed"]) == (20, 15, 5)
    assert s["errors_by_status"] == {"429": 5}
    assert_pace(s)  # TTFT counts from the first content token, not the role-only chunk
    assert s["goodput"]["num_good"] == 15
    sent = sorted(r["scheduled_s"] for r in result["requests"])
    assert 19 / (sent[-1] - sent[0]) == pytest.approx(40, rel=0.6)  # 19 Poisson gaps: loose
    assert all((tmp_path / f"chat-{kind}.png").stat().st_size > 0
               for kind in ("latency", "throughput", "distributions"))
    assert "429: 5" in capsys.readouterr().out


def test_duration_limit_and_server_without_metrics(tiny_model_dir, tmp_path, capsys):
    with FakeServer(Pace(TTFT_S, ITL_S, is_metrics=False)) as server:
        assert run(server.url, tiny_model_dir, tmp_path, "--concurrency", "2", "--duration", "0.5",
                   "--no-plots", "--no-usage") == 0
    result = load(tmp_path / "run-c2.json")
    assert result["server_metrics"] is None
    sent = [r["scheduled_s"] for r in result["requests"]]
    assert 4 <= len(sent) <= 8 and max(sent) - min(sent) < 0.5  # ~0.18 s per request, 2 at a time
    # without usage, output tokens are the tokenizer's count of the streamed text
    num_tokens = count_tokens(load_tokenizer(tiny_model_dir), CHUNK_TEXT * OUTPUT_LEN)
    assert {(r["output_tokens_source"], r["num_output_tokens"]) for r in result["requests"]} == {
        ("tokenizer", num_tokens)}
    assert_pace(result["summary"], is_one_token_per_chunk=num_tokens == OUTPUT_LEN)
    assert "no /metrics" in capsys.readouterr().out


def test_connections_are_reused(tiny_model_dir, tmp_path):
    with FakeServer(Pace(0.01, 0.002)) as server:
        assert run(server.url, tiny_model_dir, tmp_path, "--concurrency", "2", "--num-requests",
                   "10", "--no-plots", "--no-metrics") == 0
        assert httpx.get(server.url + "/connections").json() == {"num_connections": 2}


def test_compare_puts_results_side_by_side(tiny_model_dir, tmp_path, capsys):
    with FakeServer(Pace(0.01, 0.005)) as server:
        for label in ("ours", "theirs"):
            assert run(server.url, tiny_model_dir, tmp_path, "--label", label, "--num-requests", "3",
                       "--no-plots") == 0
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "ours-c1.json"), str(tmp_path / "theirs-c1.json"),
                 "--out-dir", str(tmp_path / "cmp"), "--no-plots"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split() == ["ours-c1", "theirs-c1"]
    assert rows[0].split() == ["completed", "3", "3"]


def test_unreachable_server_is_reported_not_raised(tiny_model_dir, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the run: nothing listens there
    assert run(f"http://127.0.0.1:{port}", tiny_model_dir, tmp_path, "--num-requests", "3",
               "--no-plots", "--timeout", "2") == 1
    s = load(tmp_path / "run-c1.json")["summary"]
    assert s["errors_by_status"] == {"connection": 3}


@pytest.mark.parametrize("args, message", [
    (["--rate", "-1"], "-1"), (["--slo", "fast:1"], "'fast:1'"), (["--concurrency", "0"], "got 0"),
    (["--extra-body", "[1]"], "'[1]'"), (["--label", "a/b"], "'a/b'"),
    (["--rate", "inf", "--duration", "5"], "rate inf"),
    (["--workload", "sharegpt"], "--dataset"),
])
def test_bad_arguments_name_the_value(tiny_model_dir, tmp_path, capsys, args, message):
    assert run("http://127.0.0.1:1", tiny_model_dir, tmp_path, *args) == 2
    assert message in capsys.readouterr().err


def test_compare_refuses_non_results(tmp_path, capsys):
    bogus = tmp_path / "bogus.json"
    bogus.write_text("{}")
    assert main(["compare", str(bogus), str(bogus)]) == 2
    assert "bogus.json" in capsys.readouterr().err
    assert main(["compare", str(bogus)]) == 2
