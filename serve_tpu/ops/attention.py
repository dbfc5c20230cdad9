"""Ragged paged attention over one flat token batch, and the KV-cache write.

Layout (JAX's TPU ragged paged attention kernel, DESIGN section 6):
  queries      [T, H, D]            flat batch: every sequence's new tokens, back to back
  kv_pages     [N, page_size, 2K, D] K and V interleaved on axis 2: k0, v0, k1, v1, ...
  kv_lens      i32[S]               tokens in the cache per sequence (new ones included)
  page_indices i32[S, P]            pages of each sequence, in order
  cu_q_lens    i32[S + 1]           sequence s owns query rows cu_q_lens[s]:cu_q_lens[s+1]
  num_seqs     i32[1]               sequences in use; rows past cu_q_lens[num_seqs] are padding

On TPU `ragged_paged_attention` calls the Pallas kernel; elsewhere a jittable pure-JAX
version with the same signature and the same masking. Padding rows return zeros here
(the kernel leaves them undefined): callers must ignore them.
Shape letters: T tokens, H query heads, K kv heads, G = H // K, D head dim, L = P * page_size.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as tpu_rpa

from serve_tpu import sharding

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # as the TPU kernel
_GATHER_BUDGET_BYTES = 16 * 2**20  # bytes of K/V gathered at once by the reference
_CHUNK_TOKENS = 256  # context tokens per online-softmax step of the reference


def write_kv(kv_pages: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array) -> jax.Array:
    """Store k, v [T, K, D] at flat cache slots (page * page_size + offset) i32[T]."""
    num_pages, page_size, num_combined, head_dim = kv_pages.shape
    kv = jnp.stack([k, v], axis=2).reshape(k.shape[0], num_combined, head_dim)  # [T, 2K, D]
    flat = kv_pages.reshape(num_pages * page_size, num_combined, head_dim)
    return flat.at[slots].set(kv.astype(kv_pages.dtype)).reshape(kv_pages.shape)


def ragged_paged_attention(
    queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
    *, sm_scale: float = 1.0, sliding_window: int | None = None,
    soft_cap: float | None = None, mask_value: float | None = DEFAULT_MASK_VALUE, mesh=None,
):
    """Causal attention of each query row over its own sequence's cached tokens.

    On TPU with a `mesh`, the kernel runs per device on its heads (shard_map), since a
    Pallas kernel cannot be partitioned by XLA itself.
    """
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                  mask_value=DEFAULT_MASK_VALUE if mask_value is None else mask_value)
    args = (queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if jax.devices()[0].platform == "tpu":
        kernel = functools.partial(tpu_rpa.ragged_paged_attention, **kwargs)
        if mesh is not None:
            in_specs, out_spec = sharding.attention_specs()
            kernel = jax.shard_map(kernel, mesh=mesh, in_specs=in_specs, out_specs=out_spec)
        return kernel(*args)
    return reference_ragged_paged_attention(*args, **kwargs)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "mask_value"))
def reference_ragged_paged_attention(
    queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
    *, sm_scale=1.0, sliding_window=None, soft_cap=None, mask_value=DEFAULT_MASK_VALUE,
):
    """Pure-JAX ragged paged attention.

    Rows are taken in blocks (lax.map); each block walks its sequences' pages a chunk at a
    time with an online softmax, for as many chunks as its longest row needs (a dynamic trip
    count, so cost follows the real context lengths, not the page-table width).
    """
    num_tokens = queries.shape[0]
    row = jnp.arange(num_tokens, dtype=jnp.int32)
    num_slots = kv_lens.shape[0]
    ends = jnp.where(jnp.arange(num_slots) < num_seqs[0], cu_q_lens[1:], cu_q_lens[num_seqs[0]])
    seq = jnp.minimum(jnp.searchsorted(ends, row, side="right"), num_slots - 1)  # unused slots ignored
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    position = kv_lens[seq] - q_len + (row - cu_q_lens[seq])  # [T] position of each query
    is_valid = row < cu_q_lens[num_seqs[0]]
    position = jnp.where(is_valid, position, -1)  # padding rows visit no page

    block, pages_per_chunk = _block_sizes(num_tokens, kv_pages, page_indices.shape[1])
    num_blocks = -(-num_tokens // block)

    def blocks(x):
        x = jnp.pad(x, [(0, num_blocks * block - num_tokens)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(num_blocks, block, *x.shape[1:])

    attend = functools.partial(
        _attend_rows, kv_pages=kv_pages, page_indices=page_indices, pages_per_chunk=pages_per_chunk,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, mask_value=mask_value)
    out = jax.lax.map(attend, (blocks(queries), blocks(seq), blocks(position)))
    out = out.reshape(num_blocks * block, *queries.shape[1:])[:num_tokens]
    return jnp.where(is_valid[:, None, None], out, 0).astype(queries.dtype)


def _block_sizes(num_tokens: int, kv_pages, pages_per_seq: int) -> tuple[int, int]:
    """Rows per block and pages per chunk so one gathered chunk stays within the budget."""
    _, page_size, num_combined, head_dim = kv_pages.shape
    page_bytes = page_size * num_combined * head_dim * kv_pages.dtype.itemsize
    pages_per_chunk = max(1, min(pages_per_seq, _CHUNK_TOKENS // page_size))
    block = max(1, min(num_tokens, _GATHER_BUDGET_BYTES // (page_bytes * pages_per_chunk)))
    return block, pages_per_chunk


def _attend_rows(args, *, kv_pages, page_indices, pages_per_chunk, sm_scale, sliding_window,
                 soft_cap, mask_value):
    q, seq, position = args  # [B, H, D], [B], [B]
    num_rows, num_heads, head_dim = q.shape
    page_size, num_kv_heads = kv_pages.shape[1], kv_pages.shape[2] // 2
    chunk_len = pages_per_chunk * page_size
    q = q.reshape(num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, K, G, D]
    tables = jnp.pad(page_indices[seq], ((0, 0), (0, pages_per_chunk)))  # [B, P + C]
    num_chunks = (jnp.max(position) + chunk_len) // chunk_len

    def chunk_step(c, carry):
        top, total, acc = carry  # running max [B, K, G], softmax sum [B, K, G], output [B, K, G, D]
        pages = jax.lax.dynamic_slice_in_dim(tables, c * pages_per_chunk, pages_per_chunk, axis=1)
        kv = kv_pages[pages].reshape(num_rows, chunk_len, num_kv_heads, 2, head_dim)  # [B, C, K, 2, D]
        scores = jnp.einsum("bkgd,bckd->bkgc", q, kv[..., 0, :], preferred_element_type=jnp.float32)
        scores = _mask(scores * sm_scale, c * chunk_len, position, sliding_window, soft_cap, mask_value)
        new_top = jnp.maximum(top, scores.max(axis=-1))
        probs = jnp.exp(scores - new_top[..., None])
        scale = jnp.exp(top - new_top)
        acc = acc * scale[..., None] + jnp.einsum("bkgc,bckd->bkgd", probs, kv[..., 1, :].astype(jnp.float32))
        return new_top, total * scale + probs.sum(axis=-1), acc

    stats = jnp.full(q.shape[:3], mask_value, jnp.float32), jnp.zeros(q.shape[:3], jnp.float32)
    init = (*stats, jnp.zeros(q.shape, jnp.float32))
    _, total, acc = jax.lax.fori_loop(0, num_chunks, chunk_step, init)
    out = acc / jnp.maximum(total, 1e-30)[..., None]
    return out.reshape(num_rows, num_heads, head_dim)


def _mask(scores, offset, position, sliding_window, soft_cap, mask_value):
    """Causal (and sliding-window) mask of scores [B, K, G, C] whose context starts at offset."""
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    ctx = offset + jnp.arange(scores.shape[-1], dtype=jnp.int32)
    is_visible = ctx[None, :] <= position[:, None]  # [B, C]
    if sliding_window is not None:
        is_visible &= ctx[None, :] > position[:, None] - sliding_window
    return jnp.where(is_visible[:, None, None, :], scores, mask_value)
