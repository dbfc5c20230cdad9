"""Continuous-batching scheduler: which sequences run in the next step, and how many tokens each.

Pure host Python. Each step has a token budget shared by decodes (one token each) and
prefill chunks (as many prompt tokens as fit), all in one flat batch. Running sequences
go first, oldest first; when pages run out the newest running sequence is preempted (its
pages freed, its tokens recomputed later from the front of the waiting queue). Waiting
sequences are admitted strictly first-in first-out, so none starves, after a prefix-cache
lookup that may skip part of their prefill. `schedule()` returns plain `ScheduledChunk`s.
"""

import collections
import dataclasses

from serve_tpu.engine.kv_cache import PageAllocator
from serve_tpu.engine.request import FinishReason, Sequence, SequenceStatus


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16  # sequences in one step (rows that get logits)
    max_num_tokens: int = 256  # tokens in one step (prefill chunks + decodes)
    max_model_len: int = 2048  # prompt + output tokens of one sequence

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_tokens < self.max_num_seqs:
            raise ValueError(f"SchedulerConfig.max_num_tokens ({self.max_num_tokens}) must be >= "
                             f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode")


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # position of the first token computed in this step
    num_tokens: int
    is_sampled: bool  # the chunk reaches the sequence's end, so its last row yields a token

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int) -> "ScheduledChunk":
        start = seq.num_computed
        return cls(seq, start, num_tokens, start + num_tokens == seq.num_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator):
        self.config = config
        self.allocator = allocator
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_num_tokens
        chunks, was_preempted = self._schedule_running(budget)
        budget -= sum(c.num_tokens for c in chunks)
        if not was_preempted:
            chunks += self._admit_waiting(budget)
        return chunks

    def _schedule_running(self, budget: int) -> tuple[list[ScheduledChunk], bool]:
        chunks, queue, was_preempted = [], list(self.running), False
        while queue and budget > 0:
            seq = queue.pop(0)
            num = min(seq.num_tokens - seq.num_computed, budget)
            while not self._reserve(seq, seq.num_computed + num):
                was_preempted = True
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                chunks.append(ScheduledChunk.of(seq, num))
                budget -= num
        return chunks, was_preempted

    def _admit_waiting(self, budget: int) -> list[ScheduledChunk]:
        chunks = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not seq.pages:
                seq.pages, seq.num_computed = self.allocator.match_prefix(seq.token_ids)
                seq.num_cached = seq.num_computed
            num = min(seq.num_tokens - seq.num_computed, budget)
            if not self._reserve(seq, seq.num_computed + num):
                self._release(seq)  # keep no pages pinned while waiting
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk.of(seq, num))
            budget -= num
        return chunks

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's pages to hold num_tokens; False (nothing allocated) if too few are free."""
        need = self.allocator.num_pages_for(num_tokens) - len(seq.pages)
        if need > self.allocator.num_free:
            return False
        if need > 0:
            seq.pages += self.allocator.allocate(need)
        return True

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.pages)
        seq.pages, seq.num_computed = [], 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update(self, chunks: list[ScheduledChunk], tokens) -> list[Sequence]:
        """Record a finished step: computed tokens, new cache pages, sampled tokens.
        Returns the sequences that got a new token."""
        sampled = []
        for chunk, token in zip(chunks, tokens):
            seq = chunk.seq
            seq.num_computed += chunk.num_tokens
            self.allocator.commit(seq.pages, seq.token_ids, seq.num_computed)
            if chunk.is_sampled:
                seq.output_ids.append(int(token))
                sampled.append(seq)
        return sampled

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End seq (any state): its pages go back to the allocator at once."""
        if seq.status == SequenceStatus.FINISHED:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
