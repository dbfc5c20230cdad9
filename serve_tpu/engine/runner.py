"""Runner: pads scheduled chunks into a `StepPlan` and runs it with ahead-of-time compiled steps.

`prepare(chunks, ...)` is pure host numpy: it picks the smallest (num_tokens, num_seqs)
bucket that fits and builds the model and sampling inputs. The plan is the only thing that
crosses from the scheduler to the devices, so a multi-host replica can send the same plan to
every host. `Runner` owns the KV cache and one compiled executable per bucket, all compiled
at start-up (`warmup`); a plan of any other shape is an error, never a silent recompile.
Each step runs model -> sampler on device with the cache donated.
"""

import dataclasses
import functools
import logging
import time

import jax
import numpy as np

from serve_tpu import sharding
from serve_tpu.engine.request import Sequence
from serve_tpu.engine.sampler import RowSpec, SampleOutput, SamplingInputs, build_sampling_inputs, sample
from serve_tpu.engine.scheduler import ScheduledChunk
from serve_tpu.model.generate import LoadedModel, build_inputs, init_kv_pages
from serve_tpu.model.llama import ModelInputs, forward

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Bucket:
    num_tokens: int
    num_seqs: int


def make_buckets(max_num_tokens: int, max_num_seqs: int, min_tokens: int = 16) -> tuple[Bucket, ...]:
    """Sequence sizes: 1, 4, 16, ... up to max_num_seqs (included). Token sizes: the sequence
    sizes (so pure decode steps pad nothing) plus powers of two from min_tokens up to
    max_num_tokens (included). Every pair with num_seqs <= num_tokens is a bucket."""
    seq_sizes = _ladder(1, max_num_seqs, 4)
    token_sizes = sorted(set(seq_sizes) | set(_ladder(min(min_tokens, max_num_tokens), max_num_tokens, 2)))
    return tuple(Bucket(t, s) for t in token_sizes for s in seq_sizes if s <= t)


def _ladder(start: int, stop: int, factor: int) -> list[int]:
    sizes = [start]
    while sizes[-1] * factor < stop:
        sizes.append(sizes[-1] * factor)
    return sizes + ([stop] if sizes[-1] != stop else [])


def choose_bucket(buckets, num_tokens: int, num_seqs: int) -> Bucket:
    fits = [b for b in buckets if b.num_tokens >= num_tokens and b.num_seqs >= num_seqs]
    if not fits:
        raise ValueError(f"no compiled bucket holds {num_tokens} tokens in {num_seqs} sequences")
    return min(fits, key=lambda b: (b.num_tokens, b.num_seqs))


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Everything the devices need for one step, as numpy arrays of one bucket's shapes."""

    bucket: Bucket
    inputs: ModelInputs
    sampling: SamplingInputs


def prepare(chunks: list[ScheduledChunk], buckets, pages_per_seq: int, page_size: int,
            history_len: int, eos_ids: tuple[int, ...]) -> StepPlan:
    bucket = choose_bucket(buckets, sum(c.num_tokens for c in chunks), len(chunks))
    seqs = [c.seq for c in chunks]
    model_chunks = [(s.token_ids[c.start:c.start + c.num_tokens], c.start, s.pages) for s, c in zip(seqs, chunks)]
    inputs = build_inputs(model_chunks, bucket.num_tokens, bucket.num_seqs, pages_per_seq, page_size)
    rows = [_row_spec(c.seq, eos_ids) if c.is_sampled else None for c in chunks]
    return StepPlan(bucket, inputs, build_sampling_inputs(rows, bucket.num_seqs, history_len))


def _row_spec(seq: Sequence, eos_ids) -> RowSpec:
    return RowSpec(params=seq.params, seed=seq.seed, position=len(seq.output_ids),
                   prompt_ids=seq.prompt_ids, output_ids=seq.output_ids,
                   suppressed_ids=seq.suppressed_ids(eos_ids))


def step_fn(params, kv_pages, inputs: ModelInputs, sampling: SamplingInputs, *, config, mesh):
    """The whole device step: forward over the flat batch, then per-row sampling."""
    logits, kv_pages = forward(params, kv_pages, inputs, config=config, mesh=mesh)
    return sample(logits, sampling), kv_pages


class Runner:
    def __init__(self, model: LoadedModel, buckets, num_pages: int, page_size: int,
                 pages_per_seq: int, history_len: int):
        self.model, self.buckets = model, tuple(buckets)
        self.page_size, self.pages_per_seq, self.history_len = page_size, pages_per_seq, history_len
        self.kv_pages = init_kv_pages(model, num_pages, page_size)
        self._compiled: dict[Bucket, jax.stages.Compiled] = {}

    def warmup(self) -> None:
        """Compile every bucket ahead of time, logging progress."""
        start = time.perf_counter()
        for i, bucket in enumerate(self.buckets):
            self._compiled[bucket] = self._compile(bucket)
            logger.info("compiled bucket %d/%d (tokens=%d, seqs=%d) at %.1fs", i + 1, len(self.buckets),
                        bucket.num_tokens, bucket.num_seqs, time.perf_counter() - start)

    def _compile(self, bucket: Bucket):
        mesh = self.model.mesh
        fn = functools.partial(step_fn, config=self.model.config, mesh=mesh)
        replicated = sharding.replicated(mesh)
        plan = prepare([], [bucket], self.pages_per_seq, self.page_size, self.history_len, ())
        shardings = (jax.tree.map(lambda x: x.sharding, self.model.params),
                     [sharding.kv_cache_sharding(mesh)] * len(self.kv_pages), replicated, replicated)
        jitted = jax.jit(fn, in_shardings=shardings, donate_argnums=(1,))
        return jitted.lower(self.model.params, self.kv_pages, plan.inputs, plan.sampling).compile()

    def run(self, plan: StepPlan) -> SampleOutput:
        """One step; returns the sampled tokens and log-probs as numpy arrays."""
        compiled = self._compiled.get(plan.bucket)
        if compiled is None:
            raise ValueError(f"bucket {plan.bucket} was not compiled at warm-up")
        out, self.kv_pages = compiled(self.model.params, self.kv_pages, plan.inputs, plan.sampling)
        return SampleOutput(*(np.asarray(x) for x in out))
