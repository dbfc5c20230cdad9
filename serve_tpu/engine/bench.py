"""Offline engine benchmark (`serve-tpu bench-engine`): throughput, latency, and the roofline.

Closed loop: `concurrency` requests in flight, each with `input_len` random prompt tokens and
exactly `output_len` output tokens (ignore_eos). The roofline is the time this machine
cannot beat for the same work: prefill FLOPs (logits only for the last prompt token) at
the peak FLOP rate, plus every decode step at max(weight bytes / memory bandwidth, FLOPs /
peak). Defaults are this machine kind's measured figures (DESIGN section 8).
"""

import dataclasses
import statistics
import time

import numpy as np

from serve_tpu.config import ModelConfig
from serve_tpu.engine.engine import LLMEngine
from serve_tpu.engine.request import SamplingParams

MEM_BANDWIDTH = 22e9  # bytes/s, 2-core CPU machine kind
PEAK_FLOPS = 150e9  # float32 matmul FLOP/s, same machine


@dataclasses.dataclass(frozen=True)
class Workload:
    num_requests: int
    input_len: int
    output_len: int
    concurrency: int


def run(engine: LLMEngine, work: Workload, seed: int = 0) -> dict:
    """Run the workload; returns output tokens/s, mean TTFT and mean time per output token."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=work.output_len, temperature=0.0, ignore_eos=True)
    vocab = engine.model.config.vocab_size
    pending = [rng.integers(0, vocab, work.input_len).tolist() for _ in range(work.num_requests)]
    sent, first, done = {}, {}, {}
    start = time.perf_counter()
    while pending or engine.has_work():
        while pending and len(sent) - len(done) < work.concurrency:
            rid = str(len(sent))
            engine.add_request(rid, pending.pop(), params)
            sent[rid] = time.perf_counter()
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            if out.is_finished:
                done[out.request_id] = now
    elapsed = time.perf_counter() - start
    tpot = [(done[r] - first[r]) / (work.output_len - 1) for r in done if work.output_len > 1]
    return {"elapsed_s": elapsed, "output_tokens_per_s": work.num_requests * work.output_len / elapsed,
            "ttft_ms": 1e3 * statistics.mean(first[r] - sent[r] for r in done),
            "tpot_ms": 1e3 * statistics.mean(tpot) if tpot else float("nan")}


def weight_counts(config: ModelConfig) -> tuple[int, int]:
    """(parameters used per token excluding the embedding table and lm_head, lm_head parameters)."""
    c = config
    attn = c.hidden_size * (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    mlp = 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * (attn + mlp), c.vocab_size * c.hidden_size


def roofline_s(config: ModelConfig, work: Workload, bytes_per_param: int = 4,
               bandwidth: float = MEM_BANDWIDTH, peak: float = PEAK_FLOPS) -> float:
    body, head = weight_counts(config)
    attn_per_pair = 4 * config.num_layers * config.num_heads * config.head_dim  # QK^T and PV
    prefill = work.num_requests * (2 * body * work.input_len + 2 * head
                                   + attn_per_pair * work.input_len * (work.input_len + 1) / 2)
    decode_steps = -(-work.num_requests // work.concurrency) * (work.output_len - 1)
    step_bytes = (body + head) * bytes_per_param
    step_flops = 2 * (body + head) * work.concurrency
    return prefill / peak + decode_steps * max(step_bytes / bandwidth, step_flops / peak)


def report_line(config: ModelConfig, work: Workload, result: dict, bytes_per_param: int = 4) -> str:
    bound = roofline_s(config, work, bytes_per_param)
    body, head = weight_counts(config)
    tpot_bound = 1e3 * (body + head) * bytes_per_param / MEM_BANDWIDTH
    return (f"requests={work.num_requests} in={work.input_len} out={work.output_len} "
            f"concurrency={work.concurrency} | {result['output_tokens_per_s']:.1f} output tok/s, "
            f"TTFT {result['ttft_ms']:.0f} ms, TPOT {result['tpot_ms']:.1f} ms | roofline "
            f"{work.num_requests * work.output_len / bound:.1f} tok/s (decode step >= {tpot_bound:.1f} ms), "
            f"achieved {bound / result['elapsed_s']:.0%} of roofline")
