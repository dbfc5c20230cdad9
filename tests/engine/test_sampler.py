"""Sampler: each stage against a numpy reference, seeds independent of the batch, raw log-probs.

`sample` is jitted once per shape; the shapes are few so that the file runs in seconds.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serve_tpu.engine.request import SamplingParams
from serve_tpu.engine.sampler import (HEAD_SIZE, MAX_BIAS, RowSpec, apply_min_p, apply_top_k_top_p,
                                      build_sampling_inputs, filter_logits, process_logits, sample)

HISTORY = 32
_sample = jax.jit(sample)
_process = jax.jit(process_logits)
_filter = jax.jit(filter_logits)
_top_k_top_p = jax.jit(apply_top_k_top_p)


def _row(seed=0, position=0, prompt=(), output=(), suppressed=(), **params) -> RowSpec:
    return RowSpec(SamplingParams(**params), seed, position, prompt, output, suppressed)


def _run(logits, rows, num_rows=None):
    inputs = build_sampling_inputs(rows, num_rows or len(rows), HISTORY)
    return jax.tree.map(np.asarray, _sample(jnp.asarray(logits, jnp.float32), inputs))


def _logits(num_rows, vocab, seed=0, scale=1.0):
    return (np.random.default_rng(seed).normal(size=(num_rows, vocab)) * scale).astype(np.float32)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _log_softmax(x):
    x = x.astype(np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))


# ---- greedy, temperature, bias ------------------------------------------------------------


def test_greedy_is_argmax():
    logits = _logits(8, 64)
    out = _run(logits, [_row(seed=i, temperature=0.0) for i in range(8)])
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))


def test_small_temperature_tends_to_greedy():
    logits = np.tile(np.linspace(0.0, 3.2, 64, dtype=np.float32)[::-1], (8, 1))  # gaps of 0.05
    logits = np.stack([np.roll(row, i) for i, row in enumerate(logits)])
    out = _run(logits, [_row(seed=i, position=i, temperature=1e-3) for i in range(8)])
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))


def test_logit_bias_forces_a_token():
    logits = _logits(8, 64)
    out = _run(logits, [_row(seed=i, temperature=1.0, logit_bias={17: 100.0}) for i in range(8)])
    assert (out.tokens == 17).all()


def test_suppressed_ids_are_never_chosen():
    logits = _logits(8, 64)
    logits[:, :4] += 20.0  # the four best tokens are suppressed
    rows = [_row(seed=i, temperature=0.0 if i < 2 else 1.5, suppressed=(0, 1, 2, 3)) for i in range(8)]
    out = _run(logits, rows)
    assert (out.tokens >= 4).all()


# ---- top-k, top-p, min-p ------------------------------------------------------------------


def test_top_k_1_is_greedy():
    logits = _logits(8, 64, seed=1)
    out = _run(logits, [_row(seed=i, temperature=1.5, top_k=1) for i in range(8)])
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))


def test_top_k_only_yields_the_k_largest():
    k, num_rows = 5, 512
    logits = np.tile(_logits(1, 64, seed=2), (num_rows, 1))
    out = _run(logits, [_row(seed=i, temperature=2.0, top_k=k) for i in range(num_rows)])
    assert set(out.tokens.tolist()) == set(np.argsort(-logits[0])[:k].tolist())


def _reference_filter(x, top_k, top_p, min_p):
    """vLLM's order on one row of scaled logits: top-k, then top-p on the renormalised rest,
    then min-p; returns the kept mask."""
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(x.shape, bool)
    keep[order[:top_k if top_k > 0 else len(x)]] = True
    probs = _softmax(np.where(keep, x, -np.inf).astype(np.float64))
    before = np.cumsum(probs[order]) - probs[order]  # mass of the tokens ranked above
    keep[order[before >= top_p]] = False
    probs = _softmax(np.where(keep, x, -np.inf).astype(np.float64))
    return keep & (probs >= min_p * probs.max())


def _midpoint_top_p(x, top_k, index):
    """A top_p halfway between two cumulative masses (the nucleus holds index + 2 tokens),
    so the reference is unambiguous."""
    kept = np.sort(x)[::-1][:top_k if top_k > 0 else len(x)].astype(np.float64)
    mass = np.cumsum(_softmax(kept))
    return float((mass[index] + mass[index + 1]) / 2)


@pytest.mark.parametrize("vocab,scale", [(64, 1.0), (1000, 3.0), (1000, 0.3)])  # head, head, full sort
def test_top_k_top_p_match_reference(vocab, scale):
    logits = _logits(8, vocab, seed=3, scale=scale)
    top_k = np.array([0, 0, 0, 3, 10, 50, 0, vocab + 5], np.int32)
    cut = [0, 5, vocab // 2, 1, 4, 20, vocab - 3, 0]
    top_p = np.array([_midpoint_top_p(x, k, c) for x, k, c in zip(logits, top_k, cut)], np.float32)
    top_p[[0, 7]] = 1.0
    out = np.asarray(_top_k_top_p(logits, jnp.asarray(top_k), jnp.asarray(top_p)))
    for x, got, k, p in zip(logits, out, top_k, top_p):
        want = _reference_filter(x, k, p, 0.0)
        np.testing.assert_array_equal(np.isfinite(got), want)
        np.testing.assert_array_equal(got[want], x[want])
    if scale == 0.3:  # flat rows: the nucleus reaches past the head, so the sort path ran
        assert np.isfinite(out[2]).sum() > HEAD_SIZE


def test_min_p_drops_tokens_below_a_fraction_of_the_max():
    logits = _logits(8, 64, seed=4)
    ratios = np.sort(_softmax(logits) / _softmax(logits).max(-1, keepdims=True), axis=-1)[:, ::-1]
    min_p = np.sqrt(ratios[np.arange(8), np.arange(8) * 3 + 1] * ratios[np.arange(8), np.arange(8) * 3 + 2])
    min_p[0] = 0.0
    out = np.asarray(jax.jit(apply_min_p)(logits, jnp.asarray(min_p, jnp.float32)))
    for x, got, m in zip(logits, out, min_p):
        probs = _softmax(x.astype(np.float64))
        np.testing.assert_array_equal(np.isfinite(got), probs >= m * probs.max())
    assert [np.isfinite(row).sum() for row in out] == [64] + [3 * i + 2 for i in range(1, 8)]


def test_filters_in_order_match_reference():
    logits = _logits(4, 64, seed=5, scale=2.0)
    specs = [dict(top_k=20, top_p=0.8, min_p=0.05), dict(top_k=0, top_p=0.9, min_p=0.2),
             dict(top_k=8, top_p=1.0, min_p=0.3), dict(top_k=30, top_p=0.5, min_p=0.0)]
    inputs = build_sampling_inputs([_row(**spec) for spec in specs], 4, HISTORY)
    out = np.asarray(_filter(jnp.asarray(logits), inputs))
    for x, got, spec in zip(logits, out, specs):
        np.testing.assert_array_equal(np.isfinite(got), _reference_filter(x, **spec))


def test_sampled_tokens_stay_in_the_nucleus():
    num_rows = 512
    logits = np.tile(_logits(1, 64, seed=6, scale=2.0), (num_rows, 1))
    top_p = _midpoint_top_p(logits[0], 0, 6)
    out = _run(logits, [_row(seed=i, temperature=1.0, top_p=top_p) for i in range(num_rows)])
    nucleus = np.flatnonzero(_reference_filter(logits[0], 0, top_p, 0.0))
    assert len(nucleus) == 8 and set(out.tokens.tolist()) == set(nucleus.tolist())


# ---- penalties ----------------------------------------------------------------------------


def _reference_penalties(x, prompt, output, presence, frequency, repetition, bias=()):
    x = x.copy()
    for token, value in bias:
        x[token] += np.float32(value)
    seen = sorted(set(prompt) | set(output))
    x[seen] = np.where(x[seen] > 0, x[seen] / np.float32(repetition), x[seen] * np.float32(repetition))
    counts = np.bincount(np.asarray(output, int), minlength=len(x)).astype(np.float32)
    x = x - np.float32(frequency) * counts
    return x - np.float32(presence) * (counts > 0)


def test_penalties_match_reference():
    logits = _logits(4, 64, seed=7, scale=3.0)
    specs = [  # (prompt, output, params)
        ((1, 2, 3, 2), (3, 4, 4, 4, 9), dict(repetition_penalty=1.3)),
        ((5, 6), (6, 7, 7, 8, 8, 8), dict(presence_penalty=0.7, frequency_penalty=-0.4, logit_bias={8: 2.0})),
        ((10, 11, 12), (12, 13, 13), dict(repetition_penalty=0.8, presence_penalty=-1.5, frequency_penalty=1.1)),
        ((1, 2), (2, 3), dict()),  # nothing on: left exactly as it was
    ]
    rows = [_row(prompt=p, output=o, position=len(o), **params) for p, o, params in specs]
    got = np.asarray(_process(jnp.asarray(logits), build_sampling_inputs(rows, 4, HISTORY)))
    for x, out, (prompt, output, params), row in zip(logits, got, specs, rows):
        p = row.params
        want = _reference_penalties(x, prompt, output, p.presence_penalty, p.frequency_penalty,
                                    p.repetition_penalty, p.logit_bias)
        np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[3], logits[3])


def test_greedy_takes_the_argmax_after_penalties():
    logits = np.zeros((8, 64), np.float32)
    logits[:, 5], logits[:, 9] = 3.0, 2.5
    rows = [_row(output=(5,), position=1, temperature=0.0, frequency_penalty=1.0), _row(temperature=0.0)]
    assert _run(logits, rows, num_rows=8).tokens[:2].tolist() == [9, 5]


# ---- seeds --------------------------------------------------------------------------------


def _neighbours(num):
    kinds = [dict(temperature=0.0), dict(temperature=1.0, top_k=3), dict(temperature=0.7, min_p=0.1),
             dict(temperature=1.2, repetition_penalty=1.5, presence_penalty=1.0),
             dict(temperature=1.0, logit_bias={1: 50.0}), dict(temperature=0.9, top_p=0.5), None]
    return [None if kinds[i % 7] is None else _row(seed=100 + i, position=i, prompt=(1, 2), output=(3,),
                                                   **kinds[i % 7]) for i in range(num)]


@pytest.mark.parametrize("seed", [0, 1234, 2**40 + 7, 2**63 - 1])
def test_token_depends_only_on_seed_and_position(seed):
    vocab = 1000  # flat logits: the nucleus reaches past the head, so the sort runs too
    target = _row(seed=seed, position=7, temperature=1.0, top_p=0.95)
    x = _logits(1, vocab, seed=8, scale=0.5)
    alone = _run(x, [target]).tokens[0]
    others = _logits(8, vocab, seed=9)
    for index in (0, 5):
        rows = _neighbours(8)
        rows[index] = target
        logits = others.copy()
        logits[index] = x[0]
        assert _run(logits, rows).tokens[index] == alone


def test_positions_and_seeds_give_different_draws():
    vocab = 1000
    x = np.zeros((8, vocab), np.float32)  # uniform: any repeat is chance
    by_position = np.concatenate([_run(x, [_row(seed=3, position=p + 8 * i, temperature=1.0) for p in range(8)])
                                  .tokens for i in range(2)])
    by_seed = _run(x, [_row(seed=s, position=0, temperature=1.0) for s in range(8)]).tokens
    assert len(set(by_position.tolist())) >= 14 and len(set(by_seed.tolist())) >= 7


def _chi_square(tokens, probs):
    expected = len(tokens) * probs
    observed = np.bincount(tokens, minlength=len(probs))
    return float(((observed - expected) ** 2 / expected).sum())


def test_draws_follow_the_softmax():
    """Over many seeds (and many positions of one seed) the token frequencies match
    softmax(logits / T), renormalised over the top-k when set. 99.9% chi-square bound, df = 5."""
    x = np.array([1.0, 0.5, 0.0, -0.5, -1.0, 2.0], np.float32)
    n = 1000
    rows = ([_row(seed=i, temperature=1.0) for i in range(n)]
            + [_row(seed=42, position=i, temperature=1.0) for i in range(n)]
            + [_row(seed=i, position=3, temperature=0.7, top_k=3) for i in range(n)])
    tokens = _run(np.tile(x, (3 * n, 1)), rows).tokens
    assert _chi_square(tokens[:n], _softmax(x.astype(np.float64))) < 20.5
    assert _chi_square(tokens[n:2 * n], _softmax(x.astype(np.float64))) < 20.5
    top3 = np.where(x >= np.sort(x)[-3], x / 0.7, -np.inf)
    probs = _softmax(top3.astype(np.float64))
    assert set(tokens[2 * n:].tolist()) <= {0, 1, 5}
    assert _chi_square(tokens[2 * n:], np.where(probs > 0, probs, 1e-12)) < 13.8  # df = 2


# ---- log-probs, padding, host arrays ------------------------------------------------------


def test_logprobs_are_the_raw_distribution():
    logits = _logits(8, 64, seed=10, scale=2.0)
    rows = [_row(seed=i, output=(1, 2), position=2, temperature=0.5 + 0.2 * i, top_k=5 * i,
                 presence_penalty=1.0, repetition_penalty=1.4, logit_bias={i: 5.0}) for i in range(8)]
    out = _run(logits, rows)
    raw = _log_softmax(logits)
    np.testing.assert_allclose(out.logprobs, raw[np.arange(8), out.tokens], atol=1e-5)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-raw, axis=-1, kind="stable")[:, :20])
    np.testing.assert_allclose(out.top_logprobs, np.sort(raw, axis=-1)[:, ::-1][:, :20], atol=1e-5)


def test_padding_rows_give_no_nan():
    logits = _logits(8, 64, seed=11)
    out = _run(logits, [None, _row(temperature=1.0), None], num_rows=8)
    assert np.isfinite(out.logprobs).all() and np.isfinite(out.top_logprobs).all()
    assert ((out.tokens >= 0) & (out.tokens < 64)).all()


def test_build_sampling_inputs_layout():
    rows = [_row(seed=2**40 + 5, position=3, prompt=(7, 8), output=(9, 9, 4), suppressed=(2,),
                 temperature=0.5, top_k=4, frequency_penalty=0.5, logit_bias={11: -3.0}),
            None, _row(seed=1, prompt=(7, 8), output=(1,), top_p=0.9)]
    inputs = build_sampling_inputs(rows, 4, 8)
    assert inputs.seeds.dtype == np.uint32 and inputs.seeds[0].tolist() == [2**8, 5]
    assert inputs.history[0].tolist() == [7, 8, 9, 9, 4, -1, -1, -1]
    assert inputs.is_output[0].tolist() == [False, False, True, True, True, False, False, False]
    assert (inputs.history[1:] == -1).all()  # only rows that use a penalty carry their history
    assert inputs.bias_ids[0, :3].tolist() == [11, 2, -1] and inputs.bias_values[0, :2].tolist() == [-3.0, -np.inf]
    assert inputs.temperature.tolist() == [0.5, 0.0, 1.0, 0.0] and inputs.top_k.tolist() == [4, 0, 0, 0]
    assert inputs.positions.tolist() == [3, 0, 0, 0] and inputs.bias_ids.shape == (4, MAX_BIAS)
    with pytest.raises(ValueError, match="MAX_BIAS"):
        build_sampling_inputs([_row(suppressed=tuple(range(MAX_BIAS + 1)))], 1, 8)


def _sort_depths(jaxpr, depth=0):
    """The cond-nesting depth of every sort in a jaxpr, nested jaxprs included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "sort":
            yield depth
        inner = depth + (eqn.primitive.name == "cond")
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _sort_depths(sub, inner)


def test_sort_runs_only_inside_the_filter_cond():
    num_rows, vocab = 64, 32000
    inputs = build_sampling_inputs([_row(seed=i, temperature=1.0) for i in range(num_rows)], num_rows, 64)
    jaxpr = jax.make_jaxpr(sample)(jnp.zeros((num_rows, vocab)), inputs).jaxpr
    depths = list(_sort_depths(jaxpr))
    # all-greedy cond -> draw -> top-k/top-p cond (-> full-sort fallback cond)
    assert depths and min(depths) >= 2
    top_ks = [eqn.params["k"] for eqn in jaxpr.eqns if eqn.primitive.name == "top_k"]
    assert top_ks == [20]  # outside any cond only the top-20 of the raw log-probs
