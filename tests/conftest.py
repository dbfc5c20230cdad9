"""Test set-up: 8 emulated CPU devices (set before jax is imported) and shared model fixtures."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN_MODELS = sorted(p.name for p in (FIXTURES / "models").iterdir() if p.is_dir())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from serve_tpu.model.presets import make_model

    return make_model("tiny", tmp_path_factory.mktemp("models") / "tiny")
