"""Our forward against golden logits and greedy tokens from transformers (tests/fixtures)."""

import json
import shutil

import jax
import numpy as np
import pytest

from serve_tpu.config import MeshConfig
from serve_tpu.model.generate import LoadedModel, build_inputs, generate, init_kv_pages, make_step
from tests.conftest import FIXTURES, GOLDEN_MODELS

LOGITS_ATOL = 5e-5  # float32, logits of std ~2: the max error seen is 1.6e-5


def full_logits(model: LoadedModel, prompt, page_size: int = 16) -> np.ndarray:
    """Logits at every prompt position from one prefill step."""
    num_pages = -(-len(prompt) // page_size)
    inputs = build_inputs([(prompt, 0, np.arange(1, num_pages + 1))], len(prompt), 1, num_pages, page_size)
    inputs = inputs._replace(logits_indices=np.arange(len(prompt), dtype=np.int32))
    logits, _ = make_step(model)(model.params, init_kv_pages(model, num_pages + 1, page_size), inputs)
    return np.asarray(logits)


@pytest.fixture(scope="module", params=GOLDEN_MODELS)
def golden(request):
    model_dir = FIXTURES / "models" / request.param
    return model_dir, dict(np.load(model_dir / "golden.npz"))


@pytest.mark.parametrize("tp", [1, 4])
def test_logits_match_transformers(golden, tp):
    model_dir, gold = golden
    model = LoadedModel.load(model_dir, MeshConfig(tp=tp))
    for i in (0, 1):
        np.testing.assert_allclose(full_logits(model, gold[f"prompt_{i}"]), gold[f"logits_{i}"],
                                   atol=LOGITS_ATOL, rtol=0)


def test_greedy_tokens_match_transformers(golden):
    model_dir, gold = golden
    model = LoadedModel.load(model_dir, MeshConfig(tp=2))
    for i in (0, 1):
        prompt = gold[f"prompt_{i}"].tolist()
        assert generate(model, prompt, max_tokens=24, page_size=8) == gold[f"greedy_{i}"].tolist()


def test_transformers_4_config_dialect_gives_same_logits(tmp_path):
    """Real checkpoints also carry `rope_theta` + `rope_scaling` (transformers 4.x)."""
    src = FIXTURES / "models" / "llama_gqa_rope3"
    shutil.copytree(src, tmp_path / "m")
    config = json.loads((src / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    gold = np.load(src / "golden.npz")
    model = LoadedModel.load(tmp_path / "m", MeshConfig(tp=1))
    np.testing.assert_allclose(full_logits(model, gold["prompt_1"]), gold["logits_1"], atol=LOGITS_ATOL, rtol=0)


def test_devices_are_emulated():
    assert len(jax.devices()) == 8
