"""The engine: requests in, token and text deltas out, one batched step at a time.

`LLMEngine.step()` reads: schedule -> prepare -> run (model + sampler on device) -> update.
It owns per-request state (sequences, detokenizers) and turns sampled tokens into
`RequestOutput`s. `AsyncEngine` wraps it for servers: `generate()` is an async iterator per
request, one background task runs the steps (in a worker thread, so the event loop stays
free), and `abort()` or a client that stops iterating frees the request's pages. If the
loop dies, every open request gets `EngineDeadError` and `check_health()` raises.
"""

import asyncio
import dataclasses
import hashlib
import logging
import secrets
import time

from serve_tpu.config import CacheConfig, MeshConfig
from serve_tpu.engine.kv_cache import PageAllocator
from serve_tpu.engine.request import FinishReason, SamplingParams, Sequence
from serve_tpu.engine.runner import Runner, make_buckets, prepare
from serve_tpu.engine.scheduler import Scheduler, SchedulerConfig
from serve_tpu.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from serve_tpu.model.generate import LoadedModel

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    mesh: MeshConfig = MeshConfig()
    is_prefix_caching: bool = True


@dataclasses.dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first, top_logprobs entries


@dataclasses.dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]  # new this step
    text: str  # new this step
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    num_prompt_tokens: int
    num_output_tokens: int  # all choices, so far
    num_cached_tokens: int
    is_finished: bool


@dataclasses.dataclass
class _RequestState:
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]


class EngineDeadError(RuntimeError):
    """The engine loop failed; the replica must be replaced."""


class LLMEngine:
    def __init__(self, model: LoadedModel, tokenizer: Tokenizer, config: EngineConfig = EngineConfig()):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        sched, cache = config.scheduler, config.cache
        self.pages_per_seq = -(-sched.max_model_len // cache.page_size)
        self.allocator = PageAllocator(cache.num_pages, cache.page_size, config.is_prefix_caching)
        self.scheduler = Scheduler(sched, self.allocator)
        self.buckets = make_buckets(sched.max_num_tokens, sched.max_num_seqs)
        self.runner = Runner(model, self.buckets, cache.num_pages, cache.page_size,
                             self.pages_per_seq, sched.max_model_len)
        self.eos_ids = tokenizer.eos_token_ids
        self.requests: dict[str, _RequestState] = {}

    @classmethod
    def load(cls, model_dir, config: EngineConfig = EngineConfig()) -> "LLMEngine":
        """Load weights and tokenizer, and compile every bucket."""
        engine = cls(LoadedModel.load(model_dir, config.mesh), Tokenizer(model_dir), config)
        engine.runner.warmup()
        return engine

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.validate(request_id, prompt_ids, params)
        seed = secrets.randbits(63) if params.seed is None else params.seed
        now = time.monotonic()
        seqs = [Sequence(request_id, i, list(prompt_ids), params, _choice_seed(seed, i), now) for i in range(params.n)]
        detoks = [self.tokenizer.detokenizer(prompt_ids, params.stop) for _ in seqs]
        self.requests[request_id] = _RequestState(seqs, detoks)
        for seq in seqs:
            self.scheduler.add(seq)

    def validate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming what is wrong with a request; changes nothing."""
        max_len = self.config.scheduler.max_model_len
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) + params.max_tokens > max_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                             f"exceeds the context window of {max_len} tokens")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")

    def abort(self, request_id: str) -> None:
        """End the request now; its pages are free on return."""
        state = self.requests.pop(request_id, None)
        for seq in state.seqs if state else ():
            self.scheduler.finish(seq, FinishReason.ABORT)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        plan = prepare(chunks, self.buckets, self.pages_per_seq, self.allocator.page_size,
                       self.config.scheduler.max_model_len, self.eos_ids)
        sampled = self.runner.run(plan)
        return self._update(chunks, sampled)

    def _update(self, chunks, sampled) -> list[RequestOutput]:
        self.scheduler.update(chunks, sampled.tokens)
        touched: dict[str, list[CompletionOutput]] = {}
        for row, chunk in enumerate(chunks):
            if chunk.is_sampled and chunk.seq.request_id in self.requests:
                touched.setdefault(chunk.seq.request_id, []).append(self._emit(chunk.seq, sampled, row))
        return [self._request_output(rid, outs) for rid, outs in touched.items()]

    def _emit(self, seq: Sequence, sampled, row: int) -> CompletionOutput:
        token = seq.output_ids[-1]
        detok = self.requests[seq.request_id].detokenizers[seq.index]
        delta = detok.push([token])
        reason = FinishReason.STOP if delta.stop else seq.finish_by_token(self.eos_ids, self.config.scheduler.max_model_len)
        text = delta.text + (detok.flush() if reason and not delta.stop else "")
        if reason:
            self.scheduler.finish(seq, reason)
        return CompletionOutput(seq.index, [token], text, _logprobs(seq, sampled, row), reason)

    def _request_output(self, request_id: str, outputs: list[CompletionOutput]) -> RequestOutput:
        seqs = self.requests[request_id].seqs
        is_finished = all(s.finish_reason is not None for s in seqs)
        if is_finished:
            del self.requests[request_id]
        return RequestOutput(request_id, outputs, len(seqs[0].prompt_ids), sum(len(s.output_ids) for s in seqs),
                             seqs[0].num_cached, is_finished)


def _choice_seed(seed: int, index: int) -> int:
    """Choice 0 keeps the request's seed; others get independent seeds derived from it."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _logprobs(seq: Sequence, sampled, row: int) -> list[TokenLogprob] | None:
    if not seq.params.logprobs:
        return None
    k = seq.params.top_logprobs
    top = [(int(i), float(v)) for i, v in zip(sampled.top_ids[row, :k], sampled.top_logprobs[row, :k])]
    return [TokenLogprob(int(sampled.tokens[row]), float(sampled.logprobs[row]), top)]
