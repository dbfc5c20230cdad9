"""Weights: Hugging Face safetensors and orbax checkpoints -> sharded device arrays.

`load_params(model_dir, config, mesh)` reads either a Hugging Face directory (one
`*.safetensors` file or several with `model.safetensors.index.json`) or a directory made
by `serve-tpu convert` (an `orbax/` checkpoint next to config.json). Each device's shard
is read straight from the memory-mapped file (`jax.make_array_from_callback`), so no full
host copy is made per device. Any missing or corrupt file raises `WeightsError` naming it.
"""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from serve_tpu import sharding
from serve_tpu.config import ModelConfig

ORBAX_SUBDIR = "orbax"
KV_LEAVES = ("wk", "wv", "bk", "bv")  # parameters whose heads are repeated when tp > num_kv_heads
_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}


class WeightsError(ValueError):
    """A weight file is missing, corrupt, or does not match config.json."""


class SafetensorsFile:
    """Memory-mapped tensors of one .safetensors file (header checked on open)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            raw = np.memmap(path, dtype=np.uint8, mode="r")
            header_len = int(raw[:8].view("<u8")[0])
            if 8 + header_len > raw.size:
                raise ValueError(f"header length {header_len} exceeds the file size {raw.size}")
            header = json.loads(bytes(raw[8:8 + header_len]))
        except (OSError, ValueError, IndexError, UnicodeDecodeError) as e:
            raise WeightsError(f"corrupt safetensors file {path}: {e}") from e
        if not isinstance(header, dict):
            raise WeightsError(f"corrupt safetensors file {path}: the header is not a JSON object")
        header.pop("__metadata__", None)
        self._data, self.tensors = raw[8 + header_len:], header
        for name, info in header.items():
            self._check_entry(name, info)

    def _check_entry(self, name: str, info) -> None:
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            dtype, shape = info["dtype"], [int(d) for d in info["shape"]]
        except (TypeError, KeyError, ValueError) as e:
            raise WeightsError(f"corrupt safetensors file {self.path}: bad header entry for {name}: {e!r}") from e
        if dtype not in _ST_DTYPES:
            raise WeightsError(f"{self.path}: tensor {name} has unsupported dtype {dtype}")
        if not 0 <= begin <= end or min(shape, default=0) < 0:
            raise WeightsError(f"corrupt safetensors file {self.path}: tensor {name} has invalid offsets or shape")
        if end > self._data.size or end - begin != _nbytes(info):
            raise WeightsError(f"corrupt safetensors file {self.path}: tensor {name} is truncated")

    def get(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        begin, end = info["data_offsets"]
        return self._data[begin:end].view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])


def _nbytes(info) -> int:
    return int(np.prod(info["shape"], dtype=np.int64)) * np.dtype(_ST_DTYPES[info["dtype"]]).itemsize


def open_safetensors(model_dir: Path) -> dict[str, SafetensorsFile]:
    """Tensor name -> the file holding it, following the index file if there is one."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        names = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not names:
        raise WeightsError(f"no *.safetensors files in {model_dir}")
    by_tensor = {}
    for name in names:
        if not (model_dir / name).is_file():
            raise WeightsError(f"weight file {model_dir / name} named in {index.name} is missing")
        f = SafetensorsFile(model_dir / name)
        by_tensor.update({t: f for t in f.tensors})
    return by_tensor


def hf_names(config: ModelConfig) -> dict:
    """Our params pytree with each leaf replaced by its Hugging Face tensor name."""
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        layer = {"attn_norm": p + "input_layernorm.weight", "mlp_norm": p + "post_attention_layernorm.weight",
                 "wo": p + "self_attn.o_proj.weight", "w_gate": p + "mlp.gate_proj.weight",
                 "w_up": p + "mlp.up_proj.weight", "w_down": p + "mlp.down_proj.weight"}
        for x in "qkv":
            layer[f"w{x}"] = p + f"self_attn.{x}_proj.weight"
            if config.is_qkv_bias:
                layer[f"b{x}"] = p + f"self_attn.{x}_proj.bias"
        if config.is_qk_norm:
            layer.update(q_norm=p + "self_attn.q_norm.weight", k_norm=p + "self_attn.k_norm.weight")
        layers.append(layer)
    names = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "layers": layers}
    if not config.is_tied_embedding:
        names["lm_head"] = "lm_head.weight"
    return names


def _kv_repeat(config: ModelConfig, mesh) -> int:
    """How many times each KV head is repeated for this mesh (1 when tp <= num_kv_heads)."""
    return sharding.num_cache_kv_heads(config, sharding.tp_size(mesh)) // config.num_kv_heads


def _leaf_name(path) -> str:
    return path[-1].key


def load_params(model_dir, config: ModelConfig, mesh, dtype=jnp.float32):
    """Params pytree of sharded device arrays from a HF or a converted (orbax) directory."""
    model_dir = Path(model_dir)
    if (model_dir / ORBAX_SUBDIR).is_dir():
        return restore_orbax(model_dir, config, mesh, dtype)
    files = open_safetensors(model_dir)
    kv_repeat = _kv_repeat(config, mesh)

    def load(path, hf_name):
        if hf_name not in files:
            raise WeightsError(f"tensor {hf_name} is missing from the safetensors files in {model_dir}")
        leaf = _leaf_name(path)
        source = files[hf_name].get(hf_name)
        repeat = kv_repeat if leaf in KV_LEAVES else 1
        _check_shape(hf_name, source.shape, leaf, config, files[hf_name].path)
        return _place(source, leaf, repeat, config.head_dim, sharding.param_sharding(mesh, leaf), dtype)

    return jax.tree_util.tree_map_with_path(load, hf_names(config))


def hf_shape(leaf: str, config: ModelConfig) -> tuple[int, ...]:
    """Shape of a parameter as Hugging Face stores it (Linear weights are [out, in])."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {
        "embed": (c.vocab_size, c.hidden_size), "lm_head": (c.vocab_size, c.hidden_size),
        "wq": (q, c.hidden_size), "wk": (kv, c.hidden_size), "wv": (kv, c.hidden_size),
        "wo": (c.hidden_size, q), "bq": (q,), "bk": (kv,), "bv": (kv,),
        "w_gate": (c.intermediate_size, c.hidden_size), "w_up": (c.intermediate_size, c.hidden_size),
        "w_down": (c.hidden_size, c.intermediate_size), "q_norm": (c.head_dim,), "k_norm": (c.head_dim,),
    }.get(leaf, (c.hidden_size,))


def param_shape(leaf: str, config: ModelConfig) -> tuple[int, ...]:
    """Shape in our layout, before any KV-head repetition."""
    shape = hf_shape(leaf, config)
    return shape[::-1] if len(shape) == 2 and leaf != "embed" else shape


def _check_shape(hf_name, shape, leaf, config: ModelConfig, path):
    expected = hf_shape(leaf, config)
    if tuple(shape) != expected:
        raise WeightsError(f"{path}: tensor {hf_name} has shape {tuple(shape)}, config.json implies {expected}")


def _place(source: np.ndarray, leaf: str, repeat: int, head_dim: int, out_sharding, dtype):
    """Device array of `source` in our layout; each shard reads only its own rows."""
    is_matrix = source.ndim == 2 and leaf != "embed"  # HF Linear is [out, in]; ours [in, out]
    out_dim = source.shape[0]  # the axis that KV-head repetition expands
    out_len = out_dim * repeat
    shape = (source.shape[1], out_len) if is_matrix else (out_len, *source.shape[1:])

    def shard(index):
        out_index = index[1] if is_matrix else index[0]
        rows = np.arange(out_len)[out_index]
        if repeat > 1:  # row r of the repeated layout is head (r // D) // repeat of the source
            rows = (rows // head_dim // repeat) * head_dim + rows % head_dim
        if is_matrix:
            block = source[rows][:, index[0]].T
        else:
            block = source[rows][(slice(None), *index[1:])] if source.ndim > 1 else source[rows]
        return np.ascontiguousarray(block.astype(dtype))

    return jax.make_array_from_callback(shape, out_sharding, shard)


def save_orbax(params, model_dir, out_dir) -> Path:
    """Write `params` as an orbax checkpoint in out_dir, with the model's config and tokenizer."""
    import orbax.checkpoint as ocp

    model_dir, out_dir = Path(model_dir), Path(out_dir).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out_dir / f.name)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(out_dir / ORBAX_SUBDIR, params, force=True)
    return out_dir


def restore_orbax(model_dir: Path, config: ModelConfig, mesh, dtype):
    """Restore each shard straight onto its device; KV heads are repeated after if tp needs it."""
    import orbax.checkpoint as ocp

    kv_repeat = _kv_repeat(config, mesh)
    ckpt_dir = (model_dir / ORBAX_SUBDIR).absolute()

    def target(path, _):
        leaf = _leaf_name(path)
        is_kv = kv_repeat > 1 and leaf in KV_LEAVES
        spec = sharding.replicated(mesh) if is_kv else sharding.param_sharding(mesh, leaf)
        return jax.ShapeDtypeStruct(param_shape(leaf, config), dtype, sharding=spec)

    with ocp.StandardCheckpointer() as ckpt:
        try:
            params = ckpt.restore(ckpt_dir, jax.tree_util.tree_map_with_path(target, hf_names(config)))
        except Exception as e:  # orbax raises many types for a missing or damaged checkpoint
            raise WeightsError(f"cannot restore orbax checkpoint {ckpt_dir}: {e}") from e
    if kv_repeat > 1:
        params = _repeat_kv_heads(params, kv_repeat, config.head_dim, mesh)
    return params


def _repeat_kv_heads(params, repeat: int, head_dim: int, mesh):
    def expand(path, x):
        leaf = _leaf_name(path)
        if leaf not in KV_LEAVES:
            return x
        heads = x.reshape(*x.shape[:-1], -1, head_dim)
        heads = jnp.repeat(heads, repeat, axis=-2).reshape(*x.shape[:-1], -1)
        return jax.device_put(heads, sharding.param_sharding(mesh, leaf))

    return jax.tree_util.tree_map_with_path(expand, params)
