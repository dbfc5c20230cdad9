"""Ragged paged attention and the KV-cache write against JAX's own TPU-kernel oracle.

`reference_ragged_paged_attention` (our CPU path) is compared with
`ref_ragged_paged_attention` from `jax.experimental.pallas.ops.tpu.ragged_paged_attention`
on seeded random ragged batches: prefill chunks over a cached prefix, decodes, fresh
prefills, GQA and MHA, pages in shuffled order, padding rows and unused sequence slots full
of garbage. The TPU kernel itself cannot run on CPU, so its argument contract is checked
with that module's own validators on exactly what our adapter would pass it.
"""

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as tpu_rpa

from serve_tpu import sharding
from serve_tpu.config import MeshConfig
from serve_tpu.model.generate import build_inputs
from serve_tpu.ops import attention
from serve_tpu.ops.attention import reference_ragged_paged_attention, write_kv

ATOL = 2e-6  # float32; outputs are averages of N(0, 1) values (|x| < 4); largest error seen 4.8e-7


def random_batch(seed, seqs, *, num_heads, num_kv_heads, head_dim, page_size, max_seqs,
                 num_tokens, pages_per_seq=None):
    """Kernel arguments for `seqs` = [(q_len, kv_len)], pages in shuffled order.

    Everything the kernel must not read is random garbage: query rows past the last
    sequence, pages of no sequence, page-table entries past a sequence's last page, and
    the kv_lens / page_indices of unused sequence slots. Unused cu_q_lens entries repeat
    the total, as `build_inputs` writes them.
    """
    rng = np.random.default_rng(seed)
    pages_needed = [-(-kv_len // page_size) for _, kv_len in seqs]
    pages_per_seq = pages_per_seq or max(pages_needed) + 1
    num_pages = 1 + sum(pages_needed) + 3
    kv_pages = rng.standard_normal((num_pages, page_size, 2 * num_kv_heads, head_dim), np.float32)
    queries = rng.standard_normal((num_tokens, num_heads, head_dim), np.float32)
    page_indices = rng.integers(0, num_pages, (max_seqs, pages_per_seq), dtype=np.int32)
    kv_lens = rng.integers(1, pages_per_seq * page_size, max_seqs, dtype=np.int32)
    free = iter(rng.permutation(np.arange(1, num_pages)).astype(np.int32))
    for s, ((_, kv_len), count) in enumerate(zip(seqs, pages_needed)):
        page_indices[s, :count] = [next(free) for _ in range(count)]
        kv_lens[s] = kv_len
    cu_q_lens = np.zeros(max_seqs + 1, np.int32)
    cu_q_lens[1:] = sum(q_len for q_len, _ in seqs)
    cu_q_lens[1:len(seqs) + 1] = np.cumsum([q_len for q_len, _ in seqs])
    assert cu_q_lens[-1] <= num_tokens
    return queries, kv_pages, kv_lens, page_indices, cu_q_lens, np.array([len(seqs)], np.int32)


GQA = dict(num_heads=8, num_kv_heads=2, head_dim=32)
MHA = dict(num_heads=4, num_kv_heads=4, head_dim=16)
MIXED = [(5, 13), (1, 9), (7, 7), (1, 1), (3, 20), (1, 16)]  # chunk over a prefix, decodes, prefills
CASES = {
    "gqa_page4": (0, MIXED, dict(GQA, page_size=4, max_seqs=8, num_tokens=24), {}),
    "mha_page16": (1, [(1, 33), (16, 40), (1, 17), (2, 2)], dict(MHA, page_size=16, max_seqs=5,
                                                                   num_tokens=24), {}),
    "gqa_page16_long": (2, [(20, 600), (1, 300), (9, 9)], dict(GQA, page_size=16, max_seqs=4,
                                                                num_tokens=32), {}),
    "mha_page4_unpadded": (3, [(6, 6), (1, 30)], dict(MHA, page_size=4, max_seqs=2, num_tokens=7),
                           {}),
    "gqa_sliding_window": (4, MIXED, dict(GQA, page_size=4, max_seqs=8, num_tokens=24),
                           dict(sliding_window=5)),
    "mha_soft_cap": (5, [(1, 33), (16, 40), (1, 17)], dict(MHA, page_size=16, max_seqs=4,
                                                            num_tokens=20),
                     dict(soft_cap=3.0, sm_scale=1.0)),
    "gqa_window_and_cap": (6, MIXED, dict(GQA, page_size=16, max_seqs=7, num_tokens=30),
                           dict(sliding_window=3, soft_cap=2.0, sm_scale=0.5)),
}


def check_against_oracle(args, kwargs):
    num_valid = int(args[4][args[5][0]])
    kwargs = {"sm_scale": 1.0 / math.sqrt(args[0].shape[-1]), **kwargs}
    expected = np.asarray(tpu_rpa.ref_ragged_paged_attention(*args, **kwargs))
    got = np.asarray(reference_ragged_paged_attention(*map(jnp.asarray, args), **kwargs))
    assert expected.shape == (num_valid, *args[0].shape[1:])
    assert got.shape == args[0].shape and got.dtype == np.float32
    np.testing.assert_allclose(got[:num_valid], expected, atol=ATOL, rtol=0)
    assert not np.any(got[num_valid:]), "padding rows must be exactly 0"
    return got


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_jax_oracle(name):
    seed, seqs, shapes, kwargs = CASES[name]
    check_against_oracle(random_batch(seed, seqs, **shapes), kwargs)


@pytest.mark.parametrize("unused", [[0] * 6, [9, 1, 40, 0, 2, 5]], ids=["zeros", "garbage"])
def test_unused_cu_q_lens_entries_are_ignored(unused):
    """The kernel's contract: only cu_q_lens[:num_seqs + 1] is valid; the rest is anything."""
    args = random_batch(7, [(3, 9), (1, 7)], **GQA, page_size=4, max_seqs=8, num_tokens=6)
    args[4][3:] = unused  # [0, 3, 4, unused...]
    check_against_oracle(args, {})


def test_reference_in_several_row_blocks(monkeypatch):
    """A tiny gather budget splits the rows into blocks of 3; 20 rows is 7 blocks, the last padded."""
    seqs = [(5, 13), (1, 9), (7, 7), (1, 20), (4, 4)]
    args = random_batch(8, seqs, **GQA, page_size=4, max_seqs=6, num_tokens=20, pages_per_seq=6)
    num_ctx = 6 * 4  # pages_per_seq * page_size: all of it fits one context chunk
    row_bytes = num_ctx * 2 * GQA["num_kv_heads"] * GQA["head_dim"] * 4
    whole = check_against_oracle(args, {})
    reference_ragged_paged_attention.clear_cache()  # the budget is read when tracing
    monkeypatch.setattr(attention, "_GATHER_BUDGET_BYTES", 3 * row_bytes)
    try:
        jaxpr = str(reference_ragged_paged_attention.trace(*args, sm_scale=1 / math.sqrt(32)).jaxpr)
        assert "length=7" in jaxpr
        blocked = check_against_oracle(args, {})
    finally:
        reference_ragged_paged_attention.clear_cache()
    np.testing.assert_allclose(blocked, whole, atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_kv_interleaves_k_and_v_at_their_slots(dtype):
    rng = np.random.default_rng(9)
    num_pages, page_size, num_kv_heads, head_dim = 6, 4, 2, 8
    pages = rng.standard_normal((num_pages, page_size, 2 * num_kv_heads, head_dim), np.float32)
    pages = np.asarray(jnp.asarray(pages, dtype))
    k = rng.standard_normal((5, num_kv_heads, head_dim), np.float32)
    v = rng.standard_normal((5, num_kv_heads, head_dim), np.float32)
    slots = np.array([13, 2, 22, 7, 16], np.int32)  # pages 3, 0, 5, 1, 4
    got = np.asarray(jax.jit(write_kv)(jnp.asarray(pages), k, v, slots))
    expected = pages.copy()
    for t, slot in enumerate(slots):
        page, offset = divmod(slot, page_size)
        for h in range(num_kv_heads):
            expected[page, offset, 2 * h] = k[t, h].astype(expected.dtype)
            expected[page, offset, 2 * h + 1] = v[t, h].astype(expected.dtype)
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)  # written slots, and every other one unchanged
    assert np.sum(np.any(got != pages, axis=-1)) == len(slots) * 2 * num_kv_heads


def test_write_kv_then_attend_matches_oracle():
    """K at even, V at odd combined heads is the layout the kernel reads."""
    rng = np.random.default_rng(10)
    args = random_batch(10, [(4, 4)], **GQA, page_size=4, max_seqs=1, num_tokens=4)
    queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs = args
    k, v = (rng.standard_normal((4, 2, 32), np.float32) for _ in range(2))
    slots = page_indices[0, 0] * 4 + np.arange(4, dtype=np.int32)
    kv_pages = np.asarray(write_kv(jnp.asarray(kv_pages), k, v, slots))
    out = reference_ragged_paged_attention(queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    scores = np.einsum("tkgd,skd->kgts", queries.reshape(4, 2, 4, 32), k)
    scores = np.where(np.tril(np.ones((4, 4), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    expected = np.einsum("kgts,skd->tkgd", probs, v).reshape(4, 8, 32)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5, rtol=0)


def model_batch():
    """What the model passes: build_inputs' arrays, queries [T, H, D], a cache [N, page, 2K, D]."""
    chunks = [(list(range(10)), 0, [3, 1]), ([5], 20, [4, 2]), (list(range(5)), 8, [5, 6])]
    inputs = build_inputs(chunks, num_rows=24, max_seqs=4, pages_per_seq=2, page_size=16)
    queries = jnp.zeros((24, 8, 32), jnp.float32)
    kv_pages = jnp.zeros((7, 16, 2 * 8, 32), jnp.float32)  # 8 cache KV heads: tp=8, repeated
    args = (queries, kv_pages, *map(jnp.asarray, inputs[3:7]))
    return args, dict(sm_scale=1 / math.sqrt(32), sliding_window=None, soft_cap=None,
                      mask_value=attention.DEFAULT_MASK_VALUE)


def test_model_inputs_pass_kernel_validation():
    args, kwargs = model_batch()
    tpu_rpa.static_validate_inputs(*args, **kwargs)
    tpu_rpa.dynamic_validate_inputs(*args, **kwargs)  # runtime checks: q_len <= kv_len, ...
    assert [a.dtype for a in args[2:]] == [jnp.int32] * 4


class _JaxOnTpu:
    """The `jax` module as attention.py sees it, except that the devices claim to be TPUs
    and shard_map skips its replication check (the reference standing in for the kernel
    starts its loop carry unvarying, which that check rejects; the specs are unchanged)."""

    def __getattr__(self, name):
        return getattr(jax, name)

    @staticmethod
    def devices():
        return [types.SimpleNamespace(platform="tpu")]

    @staticmethod
    def shard_map(f, **kwargs):
        return jax.shard_map(f, check_vma=False, **kwargs)


@pytest.mark.parametrize("tp", [None, 8])
def test_tpu_adapter_passes_validated_arguments(monkeypatch, tp):
    """The TPU branch of ragged_paged_attention, with the kernel replaced by a stub that
    validates what it gets (per device under shard_map) and answers with the reference."""
    calls = []

    def kernel(*args, **kwargs):
        tpu_rpa.static_validate_inputs(*args, **kwargs)
        calls.append(([a.shape for a in args], kwargs))
        return reference_ragged_paged_attention(*args, **kwargs)

    monkeypatch.setattr(attention, "jax", _JaxOnTpu())
    monkeypatch.setattr(attention, "tpu_rpa", types.SimpleNamespace(ragged_paged_attention=kernel))
    args, kwargs = model_batch()
    rng = np.random.default_rng(11)
    args = (rng.standard_normal(args[0].shape, np.float32),
            rng.standard_normal(args[1].shape, np.float32), *args[2:])
    mesh = tp and sharding.make_mesh(MeshConfig(tp=tp))
    got = attention.ragged_paged_attention(*args, sm_scale=kwargs["sm_scale"], mask_value=None, mesh=mesh)
    assert calls, "the TPU branch was not taken"
    shapes, passed = calls[0]
    per_device = tp or 1
    assert shapes[:2] == [(24, 8 // per_device, 32), (7, 16, 16 // per_device, 32)]
    assert shapes[2:] == [(4,), (4, 2), (5,), (1,)]
    assert passed == kwargs  # mask_value None becomes the kernel's default
    expected = reference_ragged_paged_attention(*args, sm_scale=kwargs["sm_scale"])
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=ATOL, rtol=0)
