"""Workloads: exact and seeded random prompts, shared prefixes, the ShareGPT loader."""

import json

import numpy as np
import pytest

from loadtests.workloads import (count_tokens, lengths, load_tokenizer, random_prompts,
                                 shared_prefix_prompts, sharegpt_prompts)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_random_prompts_have_exact_lengths(tokenizer):
    prompts = random_prompts(tokenizer, 40, input_len=100, output_len=7, seed=3)
    assert [p.num_prompt_tokens for p in prompts] == [100] * 40
    assert all(count_tokens(tokenizer, p.text) == 100 for p in prompts)
    assert {p.max_tokens for p in prompts} == {7}
    assert len({p.text for p in prompts}) == 40


def test_random_prompts_with_distributed_lengths(tokenizer):
    prompts = random_prompts(tokenizer, 60, input_len=50, output_len=20, range_ratio=0.5, seed=1)
    inputs = [p.num_prompt_tokens for p in prompts]
    outputs = [p.max_tokens for p in prompts]
    assert min(inputs) >= 25 and max(inputs) <= 75 and len(set(inputs)) > 10
    assert min(outputs) >= 10 and max(outputs) <= 30 and len(set(outputs)) > 5
    assert all(count_tokens(tokenizer, p.text) == p.num_prompt_tokens for p in prompts)


def test_random_prompts_are_seeded(tokenizer):
    first = random_prompts(tokenizer, 5, 30, 5, range_ratio=0.3, seed=11)
    assert first == random_prompts(tokenizer, 5, 30, 5, range_ratio=0.3, seed=11)
    assert first != random_prompts(tokenizer, 5, 30, 5, range_ratio=0.3, seed=12)


def test_lengths_validate_and_stay_positive():
    assert lengths(1, 0.9, 100, np.random.default_rng(0)).min() >= 1
    with pytest.raises(ValueError, match="range ratio"):
        lengths(10, 1.5, 3, np.random.default_rng(0))
    with pytest.raises(ValueError, match="got 0"):
        lengths(0, 0.0, 3, np.random.default_rng(0))


def test_shared_prefix_prompts_share_their_group_prefix(tokenizer):
    prompts = shared_prefix_prompts(tokenizer, 9, num_prefixes=3, prefix_len=64, input_len=16,
                                    output_len=4, seed=0)
    prefix_ids = [tokenizer.encode(p.text, add_special_tokens=False)[:60] for p in prompts]
    for i, ids in enumerate(prefix_ids):
        assert ids == prefix_ids[i % 3]  # same group: same leading tokens
    assert prefix_ids[0] != prefix_ids[1] != prefix_ids[2]
    assert len({p.text for p in prompts}) == 9
    assert all(78 <= p.num_prompt_tokens <= 82 for p in prompts)  # 64 + 16, give or take a merge


def test_sharegpt_loader_filters_and_shuffles(tokenizer, tmp_path):
    long = "the quick brown fox jumps over the lazy dog " * 4
    data = [{"conversations": [{"from": "human", "value": f"{long} question {i}"},
                               {"from": "gpt", "value": f"{long} answer {i}"}]} for i in range(6)]
    data.append({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": long}]})
    data.append({"messages": [{"role": "user", "content": long},
                              {"role": "assistant", "content": long}]})
    data.append({"conversations": [{"from": "human", "value": long}]})  # no reply: skipped
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    prompts = sharegpt_prompts(tokenizer, path, num_prompts=100, seed=0)
    assert len(prompts) == 7  # "hi" is too short, the last has no reply
    assert prompts != sharegpt_prompts(tokenizer, path, num_prompts=100, seed=1)
    replies = {d["conversations"][0]["value"]: d["conversations"][1]["value"] for d in data[:6]}
    replies[long] = long
    for p in prompts:  # output length = the reply's token count
        assert p.max_tokens == count_tokens(tokenizer, replies[p.text])
    assert {p.max_tokens for p in sharegpt_prompts(tokenizer, path, 3, output_len=9)} == {9}


def test_sharegpt_loader_names_bad_files(tokenizer, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        sharegpt_prompts(tokenizer, bad, 1)
    bad.write_text("[]")
    with pytest.raises(ValueError, match="no usable conversations"):
        sharegpt_prompts(tokenizer, bad, 1)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(tmp_path / "nowhere")
