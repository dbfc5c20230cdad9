"""Tensor parallelism over 1, 2, 4 and 8 emulated devices gives the unsharded result."""

import numpy as np
import pytest

from serve_tpu import sharding
from serve_tpu.config import MeshConfig
from serve_tpu.model.generate import LoadedModel, generate
from serve_tpu.model.presets import PRESETS
from tests.model.test_parity import full_logits

PROMPT = [0, 17, 250, 3, 999, 42, 1500, 7, 8, 9, 300, 301, 302, 2000, 11, 12, 13, 14, 15, 16, 5]


@pytest.fixture(scope="module")
def unsharded(tiny_model_dir):
    model = LoadedModel.load(tiny_model_dir, MeshConfig(tp=1))
    return full_logits(model, PROMPT), generate(model, PROMPT, max_tokens=12)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_sharded_equals_unsharded(tiny_model_dir, unsharded, tp):
    model = LoadedModel.load(tiny_model_dir, MeshConfig(tp=tp))
    assert model.mesh.size == tp
    logits, tokens = unsharded
    np.testing.assert_allclose(full_logits(model, PROMPT), logits, atol=1e-5, rtol=0)
    assert generate(model, PROMPT, max_tokens=12) == tokens


def test_tiny_preset_needs_kv_head_repetition_at_tp8():
    assert PRESETS["tiny"]["num_key_value_heads"] == 2  # so tp=8 exercises the repeat path


@pytest.mark.parametrize(("heads", "kv_heads", "tp", "expected"), [
    (8, 2, 1, 2), (8, 2, 2, 2), (8, 2, 4, 4), (8, 2, 8, 8), (8, 8, 4, 8), (12, 4, 4, 4)])
def test_num_cache_kv_heads(heads, kv_heads, tp, expected, tiny_model_dir):
    from dataclasses import replace

    from serve_tpu.config import ModelConfig

    config = replace(ModelConfig.from_pretrained(tiny_model_dir), num_heads=heads, num_kv_heads=kv_heads)
    assert sharding.num_cache_kv_heads(config, tp) == expected


@pytest.mark.parametrize(("heads", "kv_heads", "tp", "message"), [
    (12, 4, 8, "num_heads=12 is not divisible by tp=8"),
    (8, 3, 4, "tp=4 is not a multiple of num_kv_heads=3"),
    (8, 6, 4, "num_kv_heads=6 is not divisible by tp=4")])
def test_num_cache_kv_heads_errors(heads, kv_heads, tp, message, tiny_model_dir):
    from dataclasses import replace

    from serve_tpu.config import ModelConfig

    config = replace(ModelConfig.from_pretrained(tiny_model_dir), num_heads=heads, num_kv_heads=kv_heads)
    with pytest.raises(ValueError, match=message):
        sharding.num_cache_kv_heads(config, tp)


def test_mesh_larger_than_devices_is_an_error():
    with pytest.raises(ValueError, match="tp=16 exceeds the 8 available devices"):
        sharding.make_mesh(MeshConfig(tp=16))
