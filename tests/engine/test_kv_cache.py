"""Tests for the host-side page allocator: unit tests per method, prefix caching behaviour,
and a hypothesis state machine that runs random request workloads against a model of which
tokens each page holds."""

import collections
import dataclasses

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from serve_tpu.engine.kv_cache import NoFreePagesError, PageAllocator


def _state(allocator: PageAllocator) -> tuple:
    """Everything observable about an allocator, to check an operation changed nothing."""
    refs = tuple(allocator.num_refs(p) for p in range(1, allocator.num_pages))
    return refs, allocator.num_free, allocator.usage()


def _prefill(allocator: PageAllocator, token_ids: list[int]) -> tuple[list[int], int]:
    """What the scheduler does for a new prompt: match, allocate the rest, compute, commit."""
    pages, num_cached = allocator.match_prefix(token_ids)
    pages += allocator.allocate(allocator.num_pages_for(len(token_ids)) - len(pages))
    allocator.commit(pages, token_ids, len(token_ids))
    return pages, num_cached


@pytest.mark.parametrize(
    "num_pages, page_size, message",
    [(1, 4, "num_pages must be >= 2 .* got 1"), (0, 4, "got 0"), (8, 0, "page_size .* got 0"), (8, -1, "got -1")],
)
def test_init_rejects_bad_sizes(num_pages, page_size, message):
    with pytest.raises(ValueError, match=message):
        PageAllocator(num_pages, page_size)


def test_negative_counts_are_rejected_naming_the_value():
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -1"):
        PageAllocator(8, 4).num_pages_for(-1)
    with pytest.raises(ValueError, match="got -2"):
        PageAllocator(8, 4).allocate(-2)


def test_fresh_allocator_counts():
    allocator = PageAllocator(num_pages=8, page_size=4)
    assert (allocator.page_size, allocator.num_usable, allocator.num_free, allocator.usage()) == (4, 7, 7, 0.0)
    allocator.check_invariants()


@pytest.mark.parametrize("num_tokens, expected", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_num_pages_for_rounds_up(num_tokens, expected):
    assert PageAllocator(8, 4).num_pages_for(num_tokens) == expected


def test_allocate_hands_out_distinct_usable_pages():
    allocator = PageAllocator(num_pages=8, page_size=4)
    pages = allocator.allocate(7)
    assert sorted(pages) == list(range(1, 8))  # page 0 is never handed out
    assert all(allocator.num_refs(p) == 1 for p in pages)
    assert allocator.num_free == 0 and allocator.usage() == 1.0
    assert allocator.allocate(0) == []
    allocator.free(pages[:3])
    assert allocator.num_free == 3 and allocator.usage() == pytest.approx(4 / 7)
    assert all(allocator.num_refs(p) == 0 for p in pages[:3])
    allocator.check_invariants()


def test_allocate_too_many_raises_and_changes_nothing():
    allocator = PageAllocator(num_pages=8, page_size=4)
    allocator.allocate(5)
    before = _state(allocator)
    with pytest.raises(NoFreePagesError, match="asked for 3 pages but only 2 are free"):
        allocator.allocate(3)
    assert _state(allocator) == before
    assert len(allocator.allocate(2)) == 2
    allocator.check_invariants()


def test_free_twice_raises_naming_the_page():
    allocator = PageAllocator(num_pages=8, page_size=4)
    pages = allocator.allocate(2)
    allocator.free(pages)
    with pytest.raises(ValueError, match=f"page {pages[1]} freed 1 time"):
        allocator.free(pages[1:])
    allocator.check_invariants()


@pytest.mark.parametrize("bad_page", [0, 8, -1])
def test_free_rejects_scratch_and_unknown_pages(bad_page):
    allocator = PageAllocator(num_pages=8, page_size=4)
    allocator.allocate(7)
    with pytest.raises(ValueError, match=f"page {bad_page} "):
        allocator.free([bad_page])


def test_free_with_one_bad_page_changes_nothing():
    allocator = PageAllocator(num_pages=8, page_size=4)
    pages = allocator.allocate(3)
    allocator.free(pages[2:])
    before = _state(allocator)
    with pytest.raises(ValueError, match=f"page {pages[2]}"):
        allocator.free(pages)
    with pytest.raises(ValueError, match=f"page {pages[0]} freed 2 time"):
        allocator.free([pages[0], pages[0]])
    assert _state(allocator) == before
    allocator.check_invariants()


def test_commit_rejects_bad_arguments():
    allocator = PageAllocator(num_pages=8, page_size=2)
    pages = allocator.allocate(1)
    with pytest.raises(ValueError, match="num_computed_tokens=5"):
        allocator.commit(pages, [1, 2, 3], 5)
    with pytest.raises(ValueError, match="only 1 given"):
        allocator.commit(pages, [1, 2, 3, 4], 4)
    allocator.free(pages)
    with pytest.raises(ValueError, match=f"page {pages[0]} is committed but has refcount 0"):
        allocator.commit(pages, [1, 2], 2)
    allocator.check_invariants()


def test_commit_registers_only_full_computed_pages():
    allocator = PageAllocator(num_pages=8, page_size=4)
    tokens = list(range(12)) + [99]
    pages = allocator.allocate(4)
    allocator.commit(pages, tokens, 7)  # chunked prefill: only page 0 is full
    assert allocator.match_prefix(tokens) == (pages[:1], 4)
    allocator.commit(pages, tokens, 13)  # page 0 skipped, pages 1 and 2 registered, page 3 partial
    assert allocator.match_prefix(tokens) == (pages[:3], 12)
    allocator.check_invariants()


def test_duplicate_page_keeps_existing_mapping_and_chain_continues():
    allocator = PageAllocator(num_pages=8, page_size=2)
    first = allocator.allocate(2)
    second = allocator.allocate(2)  # computed the same first page concurrently
    allocator.commit(first, [1, 2, 3, 4], 4)
    allocator.commit(second, [1, 2, 5, 6], 4)
    assert allocator.match_prefix([1, 2, 5, 6, 7]) == ([first[0], second[1]], 4)
    allocator.free([first[0], second[1]])
    allocator.free(first)
    allocator.free(second)
    # second[0] was never registered, so it went to the free list, not the cache
    assert allocator.match_prefix([1, 2, 3]) == ([first[0]], 2)
    allocator.check_invariants()


def test_prompts_sharing_two_and_a_half_pages_share_two_pages():
    allocator = PageAllocator(num_pages=16, page_size=4)
    shared = list(range(10))
    first, num_cached = _prefill(allocator, shared + [100, 101, 102])
    assert num_cached == 0
    second, num_cached = allocator.match_prefix(shared + [200, 201])
    assert second == first[:2] and num_cached == 8
    assert [allocator.num_refs(p) for p in first] == [2, 2, 1, 1]
    assert (allocator.num_prefix_queries, allocator.num_prefix_hits) == (13 + 12, 8)
    allocator.free(second)  # one free per reference
    assert [allocator.num_refs(p) for p in first] == [1, 1, 1, 1]
    allocator.free(first)
    assert allocator.num_free == 15
    allocator.check_invariants()


def test_exactly_cached_prompt_leaves_last_page_to_compute():
    allocator = PageAllocator(num_pages=16, page_size=4)
    tokens = list(range(12))
    first, _ = _prefill(allocator, tokens)
    assert allocator.match_prefix(tokens) == (first[:2], 8)
    assert allocator.match_prefix(tokens + [12]) == (first, 12)
    assert allocator.match_prefix(tokens[:4]) == ([], 0)
    assert allocator.match_prefix([]) == ([], 0)


def test_freed_pages_stay_cached_and_a_match_revives_them():
    allocator = PageAllocator(num_pages=8, page_size=4)
    tokens = list(range(12))
    pages, _ = _prefill(allocator, tokens)
    allocator.free(pages)
    assert allocator.num_free == 7 and allocator.usage() == 0.0  # cached pages count as free
    allocator.check_invariants()
    matched, num_cached = allocator.match_prefix(tokens)
    assert matched == pages[:2] and num_cached == 8
    assert [allocator.num_refs(p) for p in matched] == [1, 1]
    assert allocator.num_free == 5
    fresh = allocator.allocate(4)  # the free list goes before the cached page
    assert pages[2] not in fresh and allocator.match_prefix(tokens + [12]) == (pages, 12)
    allocator.check_invariants()


def test_eviction_is_least_recently_freed_first_and_later_pages_first():
    allocator = PageAllocator(num_pages=5, page_size=2)  # 4 usable pages
    a, _ = _prefill(allocator, [1, 1, 1, 2])
    b, _ = _prefill(allocator, [2, 2, 2, 3])
    allocator.free(a)
    allocator.free(b)
    # LRU order: a[1], a[0], b[1], b[0]
    assert allocator.allocate(1) == [a[1]]
    assert allocator.match_prefix([1, 1, 1, 2, 0]) == ([a[0]], 2)  # a[1]'s hash is gone
    allocator.free([a[0]])  # a[0] becomes most recently freed: b[1], b[0], a[0]
    assert allocator.allocate(2) == [b[1], b[0]]
    assert allocator.match_prefix([2, 2, 2, 3, 0]) == ([], 0)
    assert allocator.match_prefix([1, 1, 1, 2, 0]) == ([a[0]], 2)
    allocator.check_invariants()


def test_match_stops_at_an_evicted_page_even_if_later_pages_are_cached():
    allocator = PageAllocator(num_pages=4, page_size=2)  # 3 usable pages
    tokens = [1, 2, 3, 4, 5]
    pages, _ = _prefill(allocator, tokens)
    allocator.free(pages)
    allocator.match_prefix(tokens)
    allocator.free(pages[:1])
    allocator.free(pages[1:2])  # LRU order now: page 0 of the prompt, then page 1
    assert allocator.allocate(2) == [pages[2], pages[0]]
    assert allocator.match_prefix(tokens) == ([], 0)
    allocator.check_invariants()


def test_different_token_in_page_one_breaks_the_chain():
    allocator = PageAllocator(num_pages=16, page_size=4)
    tokens = list(range(12)) + [12]
    pages, _ = _prefill(allocator, tokens)
    changed = tokens[:5] + [99] + tokens[6:]  # page 1 differs; page 2's tokens are identical
    assert allocator.match_prefix(changed) == (pages[:1], 4)
    repeated = [0, 1, 2, 3] * 3 + [12]  # page 2 repeats page 0 but under another parent
    assert allocator.match_prefix(repeated) == (pages[:1], 4)


def test_prefix_caching_off_never_matches():
    allocator = PageAllocator(num_pages=8, page_size=2, is_prefix_caching=False)
    tokens = [1, 2, 3, 4, 5]
    pages, _ = _prefill(allocator, tokens)
    assert allocator.match_prefix(tokens) == ([], 0)
    allocator.free(pages)
    assert allocator.match_prefix(tokens) == ([], 0)
    assert allocator.num_prefix_queries == 0 and allocator.num_prefix_hits == 0
    allocator.check_invariants()


def test_reset_prefix_cache_drops_only_unreferenced_hashes():
    allocator = PageAllocator(num_pages=16, page_size=2)
    held, _ = _prefill(allocator, [1, 2, 3])
    released, _ = _prefill(allocator, [4, 5, 6])
    allocator.free(released)
    allocator.reset_prefix_cache()
    allocator.check_invariants()
    assert allocator.num_free == 15 - len(held)
    assert allocator.match_prefix([4, 5, 6]) == ([], 0)
    assert allocator.match_prefix([1, 2, 3]) == (held[:1], 2)


ALPHABET = st.integers(min_value=0, max_value=2)  # small, so prefixes collide and pages get reused


@dataclasses.dataclass
class _Request:
    token_ids: list[int]
    pages: list[int]
    num_computed_tokens: int


class AllocatorMachine(RuleBasedStateMachine):
    """Random requests against one allocator. `written` models the device: for each page
    whose KV was computed in full, the whole token prefix that KV depends on."""

    def __init__(self):
        super().__init__()
        self.allocator: PageAllocator | None = None
        self.requests: dict[int, _Request] = {}
        self.written: dict[int, tuple[int, ...]] = {}
        self.prefixes: list[list[int]] = []
        self.num_requests = 0

    @initialize(
        num_pages=st.integers(min_value=2, max_value=20),
        page_size=st.sampled_from([1, 2, 3, 4]),
        is_prefix_caching=st.sampled_from([True, True, True, False]),
        prefixes=st.lists(st.lists(ALPHABET, max_size=12), min_size=1, max_size=3),
    )
    def set_up(self, num_pages, page_size, is_prefix_caching, prefixes):
        self.allocator = PageAllocator(num_pages, page_size, is_prefix_caching)
        self.prefixes = prefixes

    @rule(data=st.data(), suffix=st.lists(ALPHABET, min_size=1, max_size=8))
    def add_request(self, data, suffix):
        prefix = data.draw(st.sampled_from(self.prefixes))
        token_ids = prefix[: data.draw(st.integers(0, len(prefix)))] + suffix
        matched, num_cached = self.allocator.match_prefix(token_ids)
        self._check_match(token_ids, matched, num_cached)
        pages = self._allocate_or_none(self.allocator.num_pages_for(len(token_ids)) - len(matched))
        if pages is None:
            self.allocator.free(matched)
            return
        request = _Request(token_ids, matched + pages, num_cached)
        self.requests[self.num_requests] = request
        self.num_requests += 1
        self._compute(request, data.draw(st.integers(num_cached, len(token_ids))))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def compute(self, data):
        request = self._pick(data)
        self._compute(request, data.draw(st.integers(request.num_computed_tokens, len(request.token_ids))))

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), new_tokens=st.lists(ALPHABET, min_size=1, max_size=4))
    def grow(self, data, new_tokens):
        request = self._pick(data)
        new_tokens = new_tokens[: self.allocator.page_size]  # needs at most one more page
        num_needed = self.allocator.num_pages_for(len(request.token_ids) + len(new_tokens)) - len(request.pages)
        pages = self._allocate_or_none(num_needed)
        if pages is not None:
            request.pages += pages
            request.token_ids += new_tokens

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.requests)))
        pages = self.requests.pop(request_id).pages
        self.allocator.free(pages)
        if any(self.allocator.num_refs(p) == 0 for p in pages):
            before = _state(self.allocator)
            with pytest.raises(ValueError, match="freed"):
                self.allocator.free(pages)
            assert _state(self.allocator) == before

    @rule()
    def reset_prefix_cache(self):
        num_free = self.allocator.num_free
        self.allocator.reset_prefix_cache()
        assert self.allocator.num_free == num_free

    @invariant()
    def pages_are_conserved(self):
        self.allocator.check_invariants()
        owners = collections.Counter(p for r in self.requests.values() for p in r.pages)
        assert 0 not in owners
        for page in range(1, self.allocator.num_pages):
            assert self.allocator.num_refs(page) == owners[page]
        assert len(owners) + self.allocator.num_free == self.allocator.num_usable
        assert self.allocator.usage() == pytest.approx(len(owners) / self.allocator.num_usable)

    @invariant()
    def shared_pages_hold_the_same_prefix(self):
        page_size = self.allocator.page_size
        holders = collections.defaultdict(list)
        for request in self.requests.values():
            assert len(set(request.pages)) == len(request.pages)
            assert len(request.pages) == self.allocator.num_pages_for(len(request.token_ids))
            for i, page in enumerate(request.pages):
                holders[page].append((i, request))
        for page, held in holders.items():
            if len(held) > 1:
                assert self.allocator.is_prefix_caching
                for i, request in held:
                    assert request.num_computed_tokens >= (i + 1) * page_size
                    assert self.written[page] == tuple(request.token_ids[: (i + 1) * page_size])

    def _pick(self, data) -> _Request:
        return self.requests[data.draw(st.sampled_from(sorted(self.requests)))]

    def _allocate_or_none(self, num: int) -> list[int] | None:
        """Allocate like the scheduler; when short, check the error left the state untouched."""
        if num > self.allocator.num_free:
            before = _state(self.allocator)
            with pytest.raises(NoFreePagesError):
                self.allocator.allocate(num)
            assert _state(self.allocator) == before
            return None
        pages = self.allocator.allocate(num)
        live = {p for r in self.requests.values() for p in r.pages}
        for page in pages:
            assert page != 0 and page not in live
            self.written.pop(page, None)  # fresh page: its old KV will be overwritten
        return pages

    def _check_match(self, token_ids: list[int], matched: list[int], num_cached: int) -> None:
        page_size = self.allocator.page_size
        assert num_cached == len(matched) * page_size < len(token_ids)
        assert self.allocator.is_prefix_caching or not matched
        for i, page in enumerate(matched):
            assert self.written.get(page) == tuple(token_ids[: (i + 1) * page_size])

    def _compute(self, request: _Request, num_computed_tokens: int) -> None:
        """Run the model up to num_computed_tokens: record the pages it filled, then commit."""
        page_size = self.allocator.page_size
        num_full_before = request.num_computed_tokens // page_size
        for i in range(num_full_before, num_computed_tokens // page_size):
            self.written[request.pages[i]] = tuple(request.token_ids[: (i + 1) * page_size])
        request.num_computed_tokens = num_computed_tokens
        self.allocator.commit(request.pages, request.token_ids, num_computed_tokens)


AllocatorMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestAllocatorMachine = AllocatorMachine.TestCase
