"""An engine on the transformers-checked llama fixture (with the tiny preset's tokenizer), shared by engine tests."""

import shutil

import pytest

from serve_tpu.config import CacheConfig, MeshConfig
from serve_tpu.engine.engine import EngineConfig, LLMEngine
from serve_tpu.engine.scheduler import SchedulerConfig
from tests.conftest import FIXTURES

# 11 usable pages of 16 tokens: four 50-token requests cannot all fit, so preemption happens.
ENGINE_CONFIG = EngineConfig(CacheConfig(num_pages=12, page_size=16),
                             SchedulerConfig(max_num_seqs=4, max_num_tokens=32, max_model_len=160),
                             MeshConfig(tp=2))


@pytest.fixture(scope="session")
def golden_model_dir(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("golden") / "llama"
    shutil.copytree(FIXTURES / "models" / "llama_gqa_rope3", out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def engine(golden_model_dir):
    return LLMEngine.load(golden_model_dir, ENGINE_CONFIG)


@pytest.fixture()
def idle_engine(engine):
    """The shared engine, checked to be idle with every page free before and after a test."""
    assert not engine.has_work() and engine.allocator.usage() == 0
    yield engine
    for request_id in list(engine.requests):
        engine.abort(request_id)
    engine.allocator.check_invariants()
    assert engine.allocator.usage() == 0
