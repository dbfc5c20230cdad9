"""Command line: `run` a load test (one run per sweep point) and `compare` result files.

`main(argv)` parses, builds a `Target`, the workload (workloads.py) and one `RunSpec` per
swept concurrency or rate, validates all of them before the first request, then runs them in
order: each prints its summary (report.format_run) and writes `<label>-<point>.json`; a sweep
ends with a side-by-side table and PNG plots. Exit status: 0, 1 when some run completed no
request at all, 2 for bad arguments (the message names the bad value).
"""

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

DEFAULT_NUM_REQUESTS = 100
DEFAULT_NUM_PROMPTS = 1000  # workload size when only a duration limits the run
DEFAULT_OUTPUT_LEN = 128


def main(argv=None, prog: str = "python -m loadtests") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_parser(sub)
    p = sub.add_parser("compare", help="put two or more result files side by side (table, plots)")
    p.add_argument("files", nargs="+", type=Path, help="result JSON files written by `run`")
    p.add_argument("--out-dir", type=Path, metavar="DIR",
                   help="where the plots go (default: the first file's folder)")
    p.add_argument("--no-plots", action="store_true", help="print the table only")
    p.set_defaults(run=_compare)
    args = parser.parse_args(argv)
    args.argv = [prog, *(sys.argv[1:] if argv is None else argv)]
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"{prog} {args.command}: error: {e}", file=sys.stderr)
        return 2


def _add_run_parser(sub) -> None:
    p = sub.add_parser("run", help="load an OpenAI-compatible server; report latency and throughput")
    _add_server_args(p.add_argument_group("server"))
    _add_workload_args(p.add_argument_group("workload"))
    _add_arrival_args(p.add_argument_group("arrival (one run per listed value)"))
    _add_output_args(p.add_argument_group("output"))
    p.set_defaults(run=_run)


def _add_server_args(g) -> None:
    g.add_argument("--base-url", required=True, metavar="URL",
                   help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    g.add_argument("--model", required=True, metavar="NAME", help="model name sent in each request")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions (default) or /v1/chat/completions")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), metavar="KEY",
                   help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--extra-body", default="{}", metavar="JSON",
                   help="JSON object merged into every request body, e.g. '{\"top_k\": 1}'")
    g.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos (output lengths are then up to the model)")
    g.add_argument("--no-usage", action="store_true",
                   help="do not ask for stream usage; count output tokens with the tokenizer")
    g.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="seconds to wait for a connection or the next chunk (default 600)")
    g.add_argument("--metrics-url", metavar="URL", help="Prometheus page (default: BASE/metrics)")
    g.add_argument("--no-metrics", action="store_true", help="do not scrape the server's metrics")
    g.add_argument("--metrics-interval", type=float, default=1.0, metavar="S",
                   help="seconds between gauge samples during a run; 0: none (default 1)")


def _add_workload_args(g) -> None:
    g.add_argument("--tokenizer", type=Path, metavar="DIR",
                   help="local Hugging Face directory (default: --model when it is one)")
    g.add_argument("--workload", choices=["random", "sharegpt", "shared-prefix"], default="random",
                   help="default random")
    g.add_argument("--input-len", type=int, default=256, metavar="N",
                   help="prompt tokens; suffix tokens for shared-prefix (default 256)")
    g.add_argument("--output-len", type=int, metavar="N", help=f"output tokens (default "
                   f"{DEFAULT_OUTPUT_LEN}; sharegpt: each reply's length)")
    g.add_argument("--range-ratio", type=float, default=0.0, metavar="R",
                   help="random: lengths uniform on [L*(1-R), L*(1+R)] (default 0: fixed)")
    g.add_argument("--dataset", type=Path, metavar="FILE", help="sharegpt: the JSON file")
    g.add_argument("--num-prefixes", type=int, default=4, metavar="N",
                   help="shared-prefix: distinct prefixes (default 4)")
    g.add_argument("--prefix-len", type=int, default=512, metavar="N",
                   help="shared-prefix: tokens per prefix (default 512)")
    g.add_argument("--num-prompts", type=int, metavar="N", help="distinct prompts, cycled "
                   f"(default: warm-up + requests, or {DEFAULT_NUM_PROMPTS})")
    g.add_argument("--seed", type=int, default=0,
                   help="seeds the workload and open-loop gaps (default 0)")


def _add_arrival_args(g) -> None:
    x = g.add_mutually_exclusive_group()
    x.add_argument("--concurrency", type=_ints, metavar="LIST",
                   help="closed loop at these concurrencies, e.g. 1,4,16 (default 1)")
    x.add_argument("--rate", type=_floats, metavar="LIST",
                   help="open loop at these request rates (req/s), e.g. 1,2,inf")
    g.add_argument("--burstiness", type=float, default=1.0, metavar="B",
                   help="open loop gamma shape: 1 Poisson (default), < 1 burstier")
    g.add_argument("--num-requests", type=int, metavar="N", help="counted requests per run "
                   f"(default {DEFAULT_NUM_REQUESTS} unless --duration)")
    g.add_argument("--duration", type=float, metavar="S", help="seconds of counted sending per run")
    g.add_argument("--warmup-requests", type=int, default=0, metavar="N",
                   help="requests sent first in each run and not counted (default 0)")


def _add_output_args(g) -> None:
    g.add_argument("--slo", nargs="+", action="extend", default=[], metavar="NAME:MS",
                   help="goodput SLOs in ms, NAME one of ttft, tpot, itl, e2e; e.g. ttft:500 tpot:50")
    g.add_argument("--label", default="run", help="names result files and plot lines (default run)")
    g.add_argument("--out-dir", type=Path, default=Path("loadtest-results"), metavar="DIR",
                   help="for result JSON and PNG files (default loadtest-results)")
    g.add_argument("--no-plots", action="store_true", help="write no PNG files")
    g.add_argument("--no-progress", action="store_true", help="no live progress bar")


def _run(args) -> int:
    from loadtests.report import format_compare, format_run, write_result
    from loadtests.runner import run
    from loadtests.workloads import count_tokens, load_tokenizer

    specs = _specs(args)  # validates every sweep point before any request is sent
    tokenizer = load_tokenizer(_tokenizer_dir(args))
    prompts, workload = _workload(args, tokenizer, _num_prompts(args))
    print(f"workload: {json.dumps(workload)}", file=sys.stderr)
    results = []
    for spec in specs:
        spec = dataclasses.replace(spec, workload=workload)
        result = run(spec, prompts, lambda text: count_tokens(tokenizer, text))
        result["config"]["command"] = args.argv
        print(format_run(result))
        print(f"wrote {write_result(result, args.out_dir)}\n")
        results.append(result)
    if len(results) > 1:
        print(format_compare(results))
    _plot(results, args.out_dir, f"{args.label}-", args.no_plots)
    return 0 if all(r["summary"]["num_completed"] for r in results) else 1


def _compare(args) -> int:
    from loadtests.report import format_compare, load_result

    if len(args.files) < 2:
        raise ValueError(f"compare needs two or more result files, got {len(args.files)}")
    results = [load_result(path) for path in args.files]
    print(format_compare(results))
    _plot(results, args.out_dir or args.files[0].parent, "compare-", args.no_plots)
    return 0


def _plot(results: list[dict], out_dir: Path, prefix: str, is_skipped: bool) -> None:
    if is_skipped:
        return
    from loadtests.plots import plot_results

    for path in plot_results(results, out_dir, prefix):
        print(f"wrote {path}")


def _specs(args) -> list:
    from loadtests.arrival import Arrival
    from loadtests.client import Target
    from loadtests.metrics import parse_slos
    from loadtests.runner import RunSpec

    target = Target(args.base_url, args.model, args.endpoint, args.api_key, not args.no_ignore_eos,
                    not args.no_usage, _json_object(args.extra_body))
    if args.concurrency is not None or args.rate is None:
        arrivals = [Arrival(concurrency=c) for c in args.concurrency or [1]]
    else:
        arrivals = [Arrival(rate=r, burstiness=args.burstiness) for r in args.rate]
    num_requests = args.num_requests
    if num_requests is None and args.duration is None:
        num_requests = DEFAULT_NUM_REQUESTS
    metrics_url = None if args.no_metrics else args.metrics_url or f"{target.root}/metrics"
    _check_label(args.label)
    return [RunSpec(target, arrival, num_requests, args.duration, args.warmup_requests, args.seed,
                    parse_slos(args.slo), args.label, metrics_url, args.metrics_interval,
                    args.timeout, not args.no_progress) for arrival in arrivals]


def _workload(args, tokenizer, num_prompts: int):
    from loadtests import workloads

    output_len = args.output_len or DEFAULT_OUTPUT_LEN
    if args.workload == "random":
        prompts = workloads.random_prompts(tokenizer, num_prompts, args.input_len, output_len,
                                           args.range_ratio, args.seed)
        params = {"input_len": args.input_len, "output_len": output_len, "range_ratio": args.range_ratio}
    elif args.workload == "shared-prefix":
        prompts = workloads.shared_prefix_prompts(tokenizer, num_prompts, args.num_prefixes,
                                                  args.prefix_len, args.input_len, output_len, args.seed)
        params = {"num_prefixes": args.num_prefixes, "prefix_len": args.prefix_len,
                  "suffix_len": args.input_len, "output_len": output_len}
    else:
        if args.dataset is None:
            raise ValueError("--workload sharegpt needs --dataset FILE")
        prompts = workloads.sharegpt_prompts(tokenizer, args.dataset, num_prompts, args.output_len,
                                             args.seed)
        params = {"dataset": str(args.dataset), "output_len": args.output_len}
    input_lens = [p.num_prompt_tokens for p in prompts]
    return prompts, {"name": args.workload, **params, "num_prompts": len(prompts),
                     "tokenizer": str(_tokenizer_dir(args)), "seed": args.seed,
                     "prompt_tokens": {"min": min(input_lens), "max": max(input_lens),
                                       "mean": sum(input_lens) / len(input_lens)}}


def _num_prompts(args) -> int:
    if args.num_prompts is not None:
        return args.num_prompts
    if args.num_requests is None and args.duration is not None:
        return DEFAULT_NUM_PROMPTS
    return (args.num_requests or DEFAULT_NUM_REQUESTS) + args.warmup_requests


def _tokenizer_dir(args) -> Path:
    if args.tokenizer is not None:
        return args.tokenizer
    if Path(args.model).is_dir():
        return Path(args.model)
    raise ValueError(f"--model {args.model!r} is not a local directory: give --tokenizer DIR "
                     "(a local Hugging Face directory with the model's tokenizer)")


def _check_label(label: str) -> None:
    if not label or not all(c.isalnum() or c in "._-" for c in label):
        raise ValueError(f"--label must be letters, digits, '.', '_' or '-', got {label!r}")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--extra-body {text!r} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--extra-body must be a JSON object, got {text!r}")
    return value


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers") from None


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of numbers") from None
    if any(math.isnan(v) for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} contains nan")
    return values
