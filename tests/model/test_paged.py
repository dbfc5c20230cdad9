"""Paged KV cache: step-by-step decode, chunked prefill and mixed batches against transformers' logits."""

import numpy as np
import pytest

from serve_tpu.config import MeshConfig
from serve_tpu.model.generate import LoadedModel, build_inputs, init_kv_pages, make_step
from tests.conftest import FIXTURES
from tests.model.test_parity import LOGITS_ATOL

PAGE_SIZE = 4
NUM_PAGES = 40


@pytest.fixture(scope="module")
def setup():
    model_dir = FIXTURES / "models" / "llama_gqa_rope3"
    gold = np.load(model_dir / "golden.npz")
    model = LoadedModel.load(model_dir, MeshConfig(tp=2))
    return model, make_step(model), gold["prompt_1"].tolist(), gold["logits_1"]


def shuffled_pages(seed: int, count: int) -> np.ndarray:
    """Non-contiguous pages from 1..NUM_PAGES-1, so page-table lookups really matter."""
    return np.random.default_rng(seed).permutation(np.arange(1, NUM_PAGES))[:count]


def run(step, model, kv, chunks, num_rows=32, max_seqs=4):
    inputs = build_inputs(chunks, num_rows, max_seqs, 12, PAGE_SIZE)
    logits, kv = step(model.params, kv, inputs)
    return np.asarray(logits)[:len(chunks)], kv


def test_decode_one_token_at_a_time_matches_full_forward(setup):
    model, step, prompt, gold = setup
    pages = shuffled_pages(0, 10)
    kv = init_kv_pages(model, NUM_PAGES, PAGE_SIZE)
    logits, kv = run(step, model, kv, [(prompt[:5], 0, pages)])
    np.testing.assert_allclose(logits[0], gold[4], atol=LOGITS_ATOL, rtol=0)
    for pos in range(5, len(prompt)):
        logits, kv = run(step, model, kv, [(prompt[pos:pos + 1], pos, pages)])
        np.testing.assert_allclose(logits[0], gold[pos], atol=LOGITS_ATOL, rtol=0)


def test_chunked_prefill_matches_full_forward(setup):
    model, step, prompt, gold = setup
    pages = shuffled_pages(1, 10)
    kv = init_kv_pages(model, NUM_PAGES, PAGE_SIZE)
    for start in range(0, len(prompt), 11):  # chunks of 11 cross page boundaries
        chunk = prompt[start:start + 11]
        logits, kv = run(step, model, kv, [(chunk, start, pages)])
        np.testing.assert_allclose(logits[0], gold[start + len(chunk) - 1], atol=LOGITS_ATOL, rtol=0)


def test_mixed_prefill_and_decode_batch_equals_separate_runs(setup):
    """Three sequences of the same prompt at different stages share one flat batch."""
    model, step, prompt, gold = setup
    a, b, c = shuffled_pages(2, 30).reshape(3, 10)
    kv = init_kv_pages(model, NUM_PAGES, PAGE_SIZE)
    _, kv = run(step, model, kv, [(prompt[:8], 0, a), (prompt[:20], 0, b)])  # cached prefixes
    chunks = [(prompt[8:15], 8, a), (prompt[20:21], 20, b), (prompt[:9], 0, c)]
    logits, kv = run(step, model, kv, chunks)
    for row, last in enumerate([14, 20, 8]):
        np.testing.assert_allclose(logits[row], gold[last], atol=LOGITS_ATOL, rtol=0)
    alone, _ = run(step, model, init_kv_pages(model, NUM_PAGES, PAGE_SIZE), [(prompt[:9], 0, c)])
    np.testing.assert_allclose(logits[2], alone[0], atol=1e-6, rtol=0)


def test_padding_rows_do_not_touch_sequence_pages(setup):
    """Padding rows write to scratch page 0 only; every other page is unchanged."""
    model, step, prompt, _ = setup
    kv = init_kv_pages(model, NUM_PAGES, PAGE_SIZE)
    _, kv = run(step, model, kv, [(prompt[:3], 0, [5])], num_rows=16)
    for layer in kv:
        layer = np.asarray(layer)
        touched = {int(p) for p in np.nonzero(np.abs(layer).sum(axis=(1, 2, 3)))[0]}
        assert touched <= {0, 5} and 5 in touched
