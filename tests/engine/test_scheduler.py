"""Scheduler invariants over random workloads (hypothesis), without a model."""

from hypothesis import given, settings, strategies as st

from serve_tpu.engine.kv_cache import PageAllocator
from serve_tpu.engine.request import FinishReason, SamplingParams, Sequence, SequenceStatus
from serve_tpu.engine.scheduler import Scheduler, SchedulerConfig

workloads = st.lists(st.tuples(st.integers(1, 60), st.integers(1, 20), st.integers(0, 3)), min_size=1, max_size=12)


def check_pages(scheduler: Scheduler) -> None:
    allocator = scheduler.allocator
    allocator.check_invariants()
    owners: dict[int, int] = {}
    for seq in scheduler.running:
        assert len(seq.pages) == allocator.num_pages_for(max(seq.num_computed, 1)) or seq.pages
        for page in seq.pages:
            owners[page] = owners.get(page, 0) + 1
    for page, count in owners.items():
        assert allocator.num_refs(page) == count  # refcount == live owners
    assert all(not s.pages for s in scheduler.waiting)


@settings(max_examples=60, deadline=None)
@given(workloads, st.integers(4, 24), st.integers(1, 4), st.sampled_from([4, 8]), st.data())
def test_random_workloads_finish_and_conserve_pages(workload, num_pages, max_num_seqs, page_size, data):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_tokens=max_num_seqs + 8, max_model_len=100)
    scheduler = Scheduler(config, PageAllocator(num_pages, page_size))
    seqs = []
    for i, (prompt_len, max_tokens, prefix) in enumerate(workload):
        if scheduler.allocator.num_pages_for(prompt_len + max_tokens) > num_pages - 1:
            continue  # a request that can never fit is rejected before the scheduler
        prompt = [prefix] * min(prompt_len, 8) + list(range(i * 100, i * 100 + max(0, prompt_len - 8)))
        seqs.append(Sequence(str(i), 0, prompt, SamplingParams(max_tokens=max_tokens), 0, 0.0))
        scheduler.add(seqs[-1])
    for _ in range(2000):
        if not scheduler.has_work():
            break
        chunks = scheduler.schedule()
        assert chunks, "a step with waiting work must schedule something"
        assert sum(c.num_tokens for c in chunks) <= config.max_num_tokens
        assert len(chunks) <= config.max_num_seqs
        assert len({id(c.seq) for c in chunks}) == len(chunks)
        check_pages(scheduler)
        for seq in scheduler.update(chunks, [7] * len(chunks)):
            if len(seq.output_ids) >= seq.params.max_tokens:
                scheduler.finish(seq, FinishReason.LENGTH)
            elif data.draw(st.integers(0, 30)) == 0:
                scheduler.finish(seq, FinishReason.ABORT)
        check_pages(scheduler)
    assert all(s.status == SequenceStatus.FINISHED for s in seqs)
    assert scheduler.allocator.usage() == 0
    assert scheduler.allocator.num_free == num_pages - 1


def test_waiting_requests_are_admitted_first_in_first_out():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_tokens=8), PageAllocator(32, 4))
    seqs = [Sequence(str(i), 0, [i] * 3, SamplingParams(max_tokens=1), 0, 0.0) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    order = []
    while scheduler.has_work():
        chunks = scheduler.schedule()
        order += [c.seq.request_id for c in chunks if c.start == 0]
        for seq in scheduler.update(chunks, [0] * len(chunks)):
            scheduler.finish(seq, FinishReason.LENGTH)
    assert order == ["0", "1", "2"]


def test_chunked_prefill_respects_the_token_budget():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_tokens=8), PageAllocator(32, 4))
    scheduler.add(Sequence("long", 0, list(range(20)), SamplingParams(max_tokens=1), 0, 0.0))
    starts = []
    for _ in range(3):
        (chunk,) = scheduler.schedule()
        starts.append((chunk.start, chunk.num_tokens, chunk.is_sampled))
        scheduler.update([chunk], [0])
    assert starts == [(0, 8, False), (8, 8, False), (16, 4, True)]
