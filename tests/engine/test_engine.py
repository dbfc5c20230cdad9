"""LLMEngine end to end on a model whose greedy tokens transformers produced (tests/fixtures)."""

import jax
import numpy as np
import pytest

from serve_tpu.engine.engine import LLMEngine
from serve_tpu.engine.request import FinishReason, InvalidParameterError, SamplingParams
from tests.conftest import FIXTURES

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def run(engine: LLMEngine, requests: dict) -> dict:
    """requests: id -> (prompt ids, params). Returns id -> {index: (token ids, text, reason)}."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, list(prompt), params)
    results = {rid: {} for rid in requests}
    while engine.has_work():
        for out in engine.step():
            for choice in out.outputs:
                ids, text, _ = results[out.request_id].get(choice.index, ([], "", None))
                results[out.request_id][choice.index] = (ids + choice.token_ids, text + choice.text,
                                                        choice.finish_reason)
    return results


def golden():
    g = np.load(FIXTURES / "models" / "llama_gqa_rope3" / "golden.npz")
    return [(g[f"prompt_{i}"].tolist(), g[f"greedy_{i}"].tolist()) for i in (0, 1)]


def test_concurrent_greedy_equals_transformers_and_solo_runs(idle_engine):
    (p0, g0), (p1, g1) = golden()
    extra = [list(range(3, 40)), list(range(100, 110))]
    requests = {"a": (p0, GREEDY), "b": (p1, GREEDY), "c": (extra[0], GREEDY), "d": (extra[1], GREEDY)}
    together = run(idle_engine, requests)
    assert together["a"][0][0] == g0 and together["b"][0][0] == g1
    for rid, request in requests.items():
        assert run(idle_engine, {rid: request})[rid][0][0] == together[rid][0][0]
    assert together["a"][0][2] == FinishReason.LENGTH


def test_preemption_and_recompute_keep_greedy_outputs(idle_engine):
    (p0, g0), (p1, g1) = golden()
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    requests = {f"r{i}": (p1[:30 + i], params) for i in range(4)}  # 4 x 5 pages > 11 free
    before = {rid: run(idle_engine, {rid: req})[rid][0][0] for rid, req in requests.items()}
    preemptions = []
    original_preempt = idle_engine.scheduler._preempt
    idle_engine.scheduler._preempt = lambda seq: (preemptions.append(seq.request_id), original_preempt(seq))
    try:
        together = run(idle_engine, requests)
    finally:
        del idle_engine.scheduler._preempt
    assert preemptions, "the workload must force preemption"
    assert {rid: r[0][0] for rid, r in together.items()} == before


def test_prefix_cache_hit_skips_prefill_and_keeps_outputs(idle_engine):
    _, (p1, g1) = golden()
    idle_engine.allocator.reset_prefix_cache()
    first = run(idle_engine, {"first": (p1, GREEDY)})["first"][0][0]
    hits = idle_engine.allocator.num_prefix_hits
    idle_engine.add_request("second", p1, GREEDY)
    outputs = idle_engine.step()
    assert outputs == [] or outputs[0].num_cached_tokens == 32
    assert idle_engine.allocator.num_prefix_hits - hits == 32  # 2 full pages of the 37-token prompt
    idle_engine.abort("second")
    assert run(idle_engine, {"third": (p1, GREEDY)})["third"][0][0] == first == g1


def test_seeded_sampling_is_the_same_whatever_shares_the_batch(idle_engine):
    prompt = list(range(20, 45))
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    alone = run(idle_engine, {"s": (prompt, params)})["s"][0][0]
    noisy = {f"n{i}": (list(range(i, i + 9)), SamplingParams(max_tokens=10, temperature=1.0, seed=i))
             for i in range(3)}
    mixed = run(idle_engine, {**noisy, "s": (prompt, params)})["s"][0][0]
    assert mixed == alone
    other_seed = run(idle_engine, {"o": (prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=99))})
    assert other_seed["o"][0][0] != alone


def test_n_choices_and_stop_strings(idle_engine):
    _, (p1, _) = golden()
    two = run(idle_engine, {"n": (p1, SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=2))})["n"]
    assert set(two) == {0, 1} and two[0][0] != two[1][0]
    assert all(len(ids) == 12 and reason == FinishReason.LENGTH for ids, _, reason in two.values())
    full_text = run(idle_engine, {"g": (p1, GREEDY)})["g"][0][1]
    stop = full_text[len(full_text) // 2:len(full_text) // 2 + 3]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,))
    ids, text, reason = run(idle_engine, {"s": (p1, params)})["s"][0]
    assert reason == FinishReason.STOP
    assert text == full_text[:full_text.index(stop)] and stop not in text


def test_logprobs_report_top_tokens(idle_engine):
    _, (p1, g1) = golden()
    idle_engine.add_request("lp", p1, SamplingParams(max_tokens=2, temperature=0.0, logprobs=True, top_logprobs=3))
    outs = [o for _ in range(8) for o in idle_engine.step()]
    (lp,) = outs[0].outputs[0].logprobs
    assert lp.token_id == g1[0] and lp.top[0][0] == g1[0] and len(lp.top) == 3
    assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_invalid_requests_name_the_problem(idle_engine):
    with pytest.raises(ValueError, match=r"prompt \(150 tokens\) plus max_tokens \(20\) exceeds the context window of 160"):
        idle_engine.add_request("x", [1] * 150, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="prompt is empty"):
        idle_engine.add_request("x", [], SamplingParams())
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 256\)"):
        idle_engine.add_request("x", [300], SamplingParams())
    with pytest.raises(InvalidParameterError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_long_random_workload_compiles_nothing_after_warmup(idle_engine):
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if "compile" in event else None)
    rng = np.random.default_rng(0)
    requests = {f"w{i}": (rng.integers(0, 256, rng.integers(1, 70)).tolist(),
                          SamplingParams(max_tokens=int(rng.integers(1, 30)), temperature=float(rng.choice([0, 1])),
                                         seed=i, ignore_eos=True)) for i in range(12)}
    results = run(idle_engine, requests)
    assert all(len(r[0][0]) == requests[rid][1].max_tokens for rid, r in results.items())
    assert compiles == []
