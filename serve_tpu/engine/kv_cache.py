"""Host-side KV page allocator: reference counts, free list and prefix cache (pure Python).

The device KV cache is `num_pages` pages of `page_size` token slots; this module owns only
the bookkeeping of which page holds what. Page 0 is the scratch page (padding rows of a batch
write there) and is never handed out; pages 1..num_pages-1 are usable.

Every usable page is in exactly one state:
  referenced  refcount > 0, owned by one or more live sequences;
  cached      refcount 0 but still holding a hashed full page, evictable in LRU order;
  free        refcount 0 and no hash.

Data flow, as the scheduler drives it:
  match_prefix(prompt)  -> cached full pages that start the prompt (one reference each)
  allocate(num)         -> fresh pages, from the free list first, then by evicting cached ones
  commit(pages, tokens, num_computed_tokens) -> hash the pages that are now full, so later
                           prompts with the same prefix can reuse them
  free(pages)           -> drop one reference each; hashed pages become cached, others free

A full page's hash chains on its parent page's hash, so a page matches only when the whole
prefix up to and including it is the same.
"""

import collections
import hashlib
import struct
from collections.abc import Sequence

SCRATCH_PAGE = 0
_ROOT_HASH = b""
_HASH_BYTES = 16


class NoFreePagesError(RuntimeError):
    """Raised by `PageAllocator.allocate` when fewer pages are obtainable than asked."""


def hash_page(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Stable content hash of one full page, chained on the hash of the page before it."""
    packed = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.blake2b(parent_hash + packed, digest_size=_HASH_BYTES).digest()


class PageAllocator:
    """Hands out KV pages with reference counts and reuses full pages across prompts."""

    def __init__(self, num_pages: int, page_size: int, is_prefix_caching: bool = True):
        """Page 0 is reserved as the scratch page (padding rows of a batch write there);
        pages 1..num_pages-1 are usable."""
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.is_prefix_caching = is_prefix_caching
        self._refcounts = [0] * num_pages
        self._free_pages = collections.deque(range(1, num_pages))
        self._cached_pages: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._page_to_hash: dict[int, bytes] = {}
        self._hash_to_page: dict[bytes, int] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up in match_prefix
        self.num_prefix_hits = 0  # of those, tokens found cached

    @property
    def num_usable(self) -> int:
        """Pages that can ever be handed out (all but the scratch page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages obtainable right now: free ones plus cached (evictable) ones."""
        return len(self._free_pages) + len(self._cached_pages)

    def usage(self) -> float:
        """Fraction of usable pages with refcount > 0 (vLLM's KV cache usage)."""
        return 1.0 - self.num_free / self.num_usable

    def num_refs(self, page: int) -> int:
        """Current reference count of `page`."""
        self._check_page(page)
        return self._refcounts[page]

    def num_pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.page_size)

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """Longest run of cached full pages that starts `token_ids`; takes one reference on each.

        At least one token is always left to compute, so the match covers at most
        len(token_ids) - 1 tokens, rounded down to whole pages. The caller owns the returned
        references (free them if the rest of the allocation fails). Returns
        (pages, num_cached_tokens); ([], 0) with prefix caching off, and then counts nothing.
        """
        if not self.is_prefix_caching:
            return [], 0
        pages = self._lookup_prefix(token_ids)
        for page in pages:
            self._take_reference(page)
        num_cached_tokens = len(pages) * self.page_size
        self.num_prefix_queries += len(token_ids)
        self.num_prefix_hits += num_cached_tokens
        return pages, num_cached_tokens

    def allocate(self, num: int) -> list[int]:
        """`num` fresh pages with refcount 1: free pages first, then least-recently-freed cached
        pages (their hash is dropped). Allocates nothing and raises NoFreePagesError if short."""
        if num < 0:
            raise ValueError(f"num pages to allocate must be >= 0, got {num}")
        if num > self.num_free:
            raise NoFreePagesError(f"asked for {num} pages but only {self.num_free} are free")
        pages = []
        for _ in range(num):
            page = self._free_pages.popleft() if self._free_pages else self._evict_oldest()
            self._refcounts[page] = 1
            pages.append(page)
        return pages

    def commit(self, pages: Sequence[int], token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register hashes for the pages completely filled by computed tokens.

        pages[i] holds token_ids[i*page_size:(i+1)*page_size]. Pages already registered are
        skipped. If an identical page is already cached under another page id, that mapping is
        kept and this page stays unregistered (the chain still continues through its hash).
        """
        if not self.is_prefix_caching:
            return
        num_full = self._num_full_pages(pages, token_ids, num_computed_tokens)
        parent_hash = _ROOT_HASH
        for i, page in enumerate(pages[:num_full]):
            known_hash = self._page_to_hash.get(page)
            if known_hash is not None:
                parent_hash = known_hash
                continue
            self._check_referenced(page)
            parent_hash = hash_page(parent_hash, token_ids[i * self.page_size : (i + 1) * self.page_size])
            if parent_hash not in self._hash_to_page:
                self._page_to_hash[page] = parent_hash
                self._hash_to_page[parent_hash] = page

    def free(self, pages: Sequence[int]) -> None:
        """Drop one reference from each page; validates all pages before changing anything.

        A page reaching refcount 0 becomes cached (most recently freed last in LRU order) if it
        has a hash, else free. Pages are released in reverse order, so a request's later pages
        are evicted before its earlier ones. Raises ValueError naming a page that is the scratch
        page or has no reference left to drop.
        """
        num_drops = collections.Counter(pages)
        for page, num in num_drops.items():
            self._check_page(page)
            if self._refcounts[page] < num:
                raise ValueError(f"page {page} freed {num} time(s) but has refcount {self._refcounts[page]}")
        for page in reversed(pages):
            self._refcounts[page] -= 1
            if self._refcounts[page] == 0:
                self._release(page)

    def reset_prefix_cache(self) -> None:
        """Drop the hashes of all refcount-0 cached pages; they become plain free pages.
        Referenced pages keep their hashes."""
        while self._cached_pages:
            self._free_pages.append(self._evict_oldest())

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (for tests and debugging)."""
        assert all(n >= 0 for n in self._refcounts), "negative refcount"
        assert self._refcounts[SCRATCH_PAGE] == 0, "scratch page is referenced"
        free, cached = set(self._free_pages), set(self._cached_pages)
        referenced = {p for p in range(1, self.num_pages) if self._refcounts[p] > 0}
        assert len(free) == len(self._free_pages), "page twice in the free list"
        assert not (free & cached) and not (free & referenced) and not (cached & referenced)
        assert free | cached | referenced == set(range(1, self.num_pages)), "page lost or scratch page listed"
        assert not (free & self._page_to_hash.keys()), "free page still has a hash"
        assert cached <= self._page_to_hash.keys(), "cached page without a hash"
        assert len(self._page_to_hash) == len(self._hash_to_page), "hash maps differ in size"
        assert all(self._hash_to_page[h] == p for p, h in self._page_to_hash.items()), "hash maps disagree"
        assert self.is_prefix_caching or not self._page_to_hash, "hashes with prefix caching off"

    def _lookup_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Cached pages matching the start of token_ids, leaving at least one token uncached."""
        num_candidates = max(0, len(token_ids) - 1) // self.page_size
        pages = []
        parent_hash = _ROOT_HASH
        for i in range(num_candidates):
            parent_hash = hash_page(parent_hash, token_ids[i * self.page_size : (i + 1) * self.page_size])
            page = self._hash_to_page.get(parent_hash)
            if page is None:
                break
            pages.append(page)
        return pages

    def _num_full_pages(self, pages: Sequence[int], token_ids: Sequence[int], num_computed_tokens: int) -> int:
        """Validate commit's arguments; return how many leading pages are full of computed tokens."""
        if not 0 <= num_computed_tokens <= len(token_ids):
            raise ValueError(f"num_computed_tokens={num_computed_tokens} is outside [0, {len(token_ids)}]")
        num_full = num_computed_tokens // self.page_size
        if num_full > len(pages):
            raise ValueError(f"{num_computed_tokens} computed tokens fill {num_full} pages but only {len(pages)} given")
        return num_full

    def _take_reference(self, page: int) -> None:
        """Add a reference; a cached page leaves the evictable set."""
        if self._refcounts[page] == 0:
            del self._cached_pages[page]
        self._refcounts[page] += 1

    def _release(self, page: int) -> None:
        """Move a page whose refcount just reached 0 to the cached set or the free list."""
        if page in self._page_to_hash:
            self._cached_pages[page] = None
        else:
            self._free_pages.append(page)

    def _evict_oldest(self) -> int:
        """Take the least recently freed cached page out of the cache and drop its hash."""
        page, _ = self._cached_pages.popitem(last=False)
        del self._hash_to_page[self._page_to_hash.pop(page)]
        return page

    def _check_page(self, page: int) -> None:
        if not SCRATCH_PAGE < page < self.num_pages:
            raise ValueError(f"page {page} is not a usable page (usable: 1..{self.num_pages - 1})")

    def _check_referenced(self, page: int) -> None:
        self._check_page(page)
        if self._refcounts[page] == 0:
            raise ValueError(f"page {page} is committed but has refcount 0")

