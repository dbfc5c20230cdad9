"""Frozen configuration of the model, the KV cache and the device mesh.

`ModelConfig.from_pretrained(dir)` reads a Hugging Face `config.json` (either dialect:
transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`, both through
`transformers.AutoConfig`) into the one form the model functions use. Anything the
model cannot run exactly raises `UnsupportedModelError` naming the value.
"""

import dataclasses
import json
import os
from pathlib import Path

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or config value this project cannot run."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position: int
    is_tied_embedding: bool
    is_qkv_bias: bool
    is_qk_norm: bool
    dtype: str = "float32"  # dtype of the stored weights
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        with open(path) as f:
            architectures = json.load(f).get("architectures") or ["<none>"]
        if architectures[0] not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {architectures[0]!r} in {path} is not supported; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        import transformers  # only for config parsing; slow to import

        hf = transformers.AutoConfig.from_pretrained(model_dir)
        return _from_hf(SUPPORTED_ARCHITECTURES[architectures[0]], hf)


def _from_hf(architecture: str, hf) -> ModelConfig:
    _check_unsupported(hf)
    num_heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    eos = hf.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelConfig(
        architecture=architecture,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        rope=_rope_from_hf(hf),
        max_position=hf.max_position_embeddings,
        is_tied_embedding=bool(hf.tie_word_embeddings),
        is_qkv_bias=architecture == "qwen2" or bool(getattr(hf, "attention_bias", False)),
        is_qk_norm=architecture == "qwen3",
        dtype=str(getattr(hf, "dtype", None) or "float32").removeprefix("torch."),
        eos_token_ids=eos_ids,
    )


def _check_unsupported(hf) -> None:
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {hf.hidden_act!r} is not supported (only 'silu')")
    if getattr(hf, "use_sliding_window", False):
        raise UnsupportedModelError("use_sliding_window=True is not supported")
    if getattr(hf, "mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=True is not supported")


def _rope_from_hf(hf) -> RopeConfig:
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if not params:  # older transformers: separate attributes
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf, "rope_theta", 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    return RopeConfig(
        theta=float(params.get("rope_theta", 10000.0)),
        type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: `num_pages` pages of `page_size` tokens; page 0 is the scratch page."""

    num_pages: int = 256
    page_size: int = 16

    def __post_init__(self):
        for name in ("num_pages", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"CacheConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_pages < 2:
            raise ValueError(f"CacheConfig.num_pages must be >= 2 (page 0 is scratch), got {self.num_pages}")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Tensor parallelism over `tp` devices (0 = all devices of the host or slice)."""

    tp: int = 0
