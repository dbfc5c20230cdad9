"""`serve-tpu` command line: make-model, generate, convert, bench-engine, loadtest.

Each subcommand parses its arguments and calls one function of the package; heavy imports
(jax, transformers) happen inside the subcommand so `serve-tpu --help` is instant.
"""

import argparse
import os
import statistics
import sys
from pathlib import Path


def main(argv=None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found" notice
    parser = argparse.ArgumentParser(prog="serve-tpu", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-model", help="write a deterministic Hugging Face model directory")
    p.add_argument("preset", help="tiny or bench")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.set_defaults(run=_make_model)

    p = sub.add_parser("generate", help="run a model offline on one prompt and print the completion")
    p.add_argument("model_dir", type=Path)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=0, help="tensor-parallel devices (0 = all)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at an end-of-sequence token")
    p.add_argument("--stats", action="store_true", help="print prefill and decode timings to stderr")
    p.set_defaults(run=_generate)

    p = sub.add_parser("convert", help="write an orbax checkpoint of a Hugging Face model directory")
    p.add_argument("hf_dir", type=Path)
    p.add_argument("out_dir", type=Path)
    p.set_defaults(run=_convert)

    p = sub.add_parser("bench-engine", help="offline engine throughput and latency next to the roofline")
    p.add_argument("model_dir", type=Path)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-num-tokens", type=int, default=256, help="token budget of one step")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--tp", type=int, default=0, help="tensor-parallel devices (0 = all)")
    p.set_defaults(run=_bench_engine)

    sub.add_parser("loadtest", help="load-test any OpenAI-compatible server (see loadtest --help)", add_help=False)

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["loadtest"]:  # its own parser: run/compare subcommands and many options
        from loadtests.cli import main as loadtest_main

        return loadtest_main(argv[1:], prog="serve-tpu loadtest")
    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"serve-tpu {args.command}: error: {e}", file=sys.stderr)
        return 2


def _make_model(args) -> None:
    from serve_tpu.model.presets import make_model

    print(make_model(args.preset, args.out_dir, args.dtype))


def _generate(args) -> None:
    from transformers import AutoTokenizer

    from serve_tpu.config import MeshConfig
    from serve_tpu.model.generate import LoadedModel, generate

    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = LoadedModel.load(args.model_dir, MeshConfig(tp=args.tp))
    stop_ids = () if args.ignore_eos else model.config.eos_token_ids
    stats = {}
    ids = generate(model, tokenizer.encode(args.prompt), args.max_tokens, args.temperature,
                   args.seed, stop_ids=stop_ids, stats=stats)
    print(tokenizer.decode(ids, skip_special_tokens=True))
    if args.stats:
        _print_stats(stats, model)


def _print_stats(stats: dict, model) -> None:
    steps = stats["decode_step_s"][1:]  # the first decode step compiles
    params = sum(x.size * x.dtype.itemsize for x in _leaves(model.params))
    print(f"prefill {stats['prefill_s'] * 1e3:.1f} ms (with compile); weights {params / 1e6:.1f} MB "
          f"on {model.mesh.size} device(s)", file=sys.stderr)
    if steps:
        median = statistics.median(steps)
        print(f"decode {len(steps)} steps: median {median * 1e3:.2f} ms/token, "
              f"{1 / median:.1f} tokens/s", file=sys.stderr)


def _leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def _bench_engine(args) -> None:
    import logging

    from serve_tpu.config import CacheConfig, MeshConfig
    from serve_tpu.engine import bench
    from serve_tpu.engine.engine import EngineConfig, LLMEngine
    from serve_tpu.engine.scheduler import SchedulerConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    work = bench.Workload(args.num_requests, args.input_len, args.output_len, args.concurrency)
    max_len = args.input_len + args.output_len
    num_pages = args.concurrency * -(-max_len // args.page_size) + 1
    config = EngineConfig(CacheConfig(num_pages, args.page_size),
                          SchedulerConfig(max(args.concurrency, 1), max(args.max_num_tokens, args.concurrency), max_len),
                          MeshConfig(tp=args.tp))
    engine = LLMEngine.load(args.model_dir, config)
    bench.run(engine, bench.Workload(1, args.input_len, 2, 1))  # touch every weight once
    result = bench.run(engine, work)
    print(bench.report_line(engine.model.config, work, result, engine.model.dtype.itemsize))


def _convert(args) -> None:
    from serve_tpu.config import MeshConfig, ModelConfig
    from serve_tpu.model.generate import LoadedModel
    from serve_tpu.model.weights import save_orbax

    # tp=1: the checkpoint keeps the original KV heads (restore repeats them if tp needs it)
    # and the stored dtype (restore casts).
    dtype = ModelConfig.from_pretrained(args.hf_dir).dtype
    model = LoadedModel.load(args.hf_dir, MeshConfig(tp=1), dtype=dtype)
    print(save_orbax(model.params, args.hf_dir, args.out_dir))


if __name__ == "__main__":
    sys.exit(main())
