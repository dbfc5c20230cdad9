"""The one place that builds a device Mesh and every PartitionSpec.

Tensor parallelism (Megatron style) over the mesh axis "model", across every device of a
host or of a multi-host slice:
- column-parallel weights (wq, wk, wv, w_gate, w_up, lm_head, embed) split their output axis,
- row-parallel weights (wo, w_down) split their input axis; XLA inserts the all-reduce,
- the KV cache splits its combined (K, V interleaved) head axis.

KV heads fewer than the tensor-parallel degree: each KV head is repeated
`tp // num_kv_heads` times at load time (as vLLM does), so every device holds exactly the
KV head its query heads need. The cache then holds `tp` heads in all; per device it is the
same size as one head. Requires `tp % num_kv_heads == 0` in that case, and always
`num_heads % tp == 0`.
"""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from serve_tpu.config import MeshConfig, ModelConfig

AXIS = "model"

# Parameter name -> PartitionSpec of its array in our layout ([in, out] for matrices).
_PARAM_SPECS = {
    "embed": P(None, AXIS),  # [V, E]: split hidden; lookup then all-gathers
    "lm_head": P(None, AXIS),  # [E, V]
    "final_norm": P(),
    "attn_norm": P(),
    "mlp_norm": P(),
    "wq": P(None, AXIS),
    "wk": P(None, AXIS),
    "wv": P(None, AXIS),
    "bq": P(AXIS),
    "bk": P(AXIS),
    "bv": P(AXIS),
    "q_norm": P(),
    "k_norm": P(),
    "wo": P(AXIS, None),
    "w_gate": P(None, AXIS),
    "w_up": P(None, AXIS),
    "w_down": P(AXIS, None),
}


def make_mesh(mesh_config: MeshConfig = MeshConfig(), devices=None) -> Mesh:
    """A 1-D mesh over `tp` devices (all of `jax.devices()` when tp is 0)."""
    devices = list(devices if devices is not None else jax.devices())
    tp = mesh_config.tp or len(devices)
    if tp > len(devices):
        raise ValueError(f"MeshConfig.tp={tp} exceeds the {len(devices)} available devices")
    return Mesh(np.array(devices[:tp]), (AXIS,))


def tp_size(mesh: Mesh) -> int:
    return mesh.shape[AXIS]


def num_cache_kv_heads(config: ModelConfig, tp: int) -> int:
    """KV heads held in the cache (and in wk/wv) for tensor-parallel degree `tp`."""
    if config.num_heads % tp:
        raise ValueError(f"num_heads={config.num_heads} is not divisible by tp={tp}")
    if config.num_kv_heads >= tp:
        if config.num_kv_heads % tp:
            raise ValueError(f"num_kv_heads={config.num_kv_heads} is not divisible by tp={tp}")
        return config.num_kv_heads
    if tp % config.num_kv_heads:
        raise ValueError(
            f"tp={tp} is not a multiple of num_kv_heads={config.num_kv_heads}, "
            "so KV heads cannot be replicated evenly"
        )
    return tp


def param_sharding(mesh: Mesh, name: str) -> NamedSharding:
    """Sharding of the parameter called `name` (a leaf name of the params pytree)."""
    return NamedSharding(mesh, _PARAM_SPECS[name])


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """[num_pages, page_size, 2 * kv_heads, head_dim], split on the head axis."""
    return NamedSharding(mesh, P(None, None, AXIS, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def attention_specs() -> tuple[tuple[P, ...], P]:
    """(in_specs, out_spec) of ragged paged attention run per device on its heads."""
    heads, cache = P(None, AXIS, None), P(None, None, AXIS, None)
    return (heads, cache, P(), P(), P(), P()), heads
