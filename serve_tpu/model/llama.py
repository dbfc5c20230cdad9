"""Pure-function forward of the Llama family, Qwen2 (QKV bias) and Qwen3 (q/k RMSNorm).

`forward(params, kv_pages, inputs, config=...)` takes one flat token batch (prefill chunks
and decode tokens of many sequences, back to back), writes their K/V into the paged cache,
and returns logits only at `inputs.logits_indices` (one row per sequence) with the new
cache. No state lives here: params and cache go in, logits and cache come out.

Params (our layout, matrices [in, out]):
  embed [V, E]; final_norm [E]; lm_head [E, V] (absent when embeddings are tied);
  layers[i]: attn_norm [E], wq [E, H*D], wk/wv [E, K*D], (bq [H*D], bk/bv [K*D]),
             (q_norm/k_norm [D]), wo [H*D, E], mlp_norm [E], w_gate/w_up [E, F], w_down [F, E]
Shape letters: T tokens, S sequences, E hidden, F intermediate, V vocab, H query heads,
K kv heads (as held in the cache, see sharding.num_cache_kv_heads), D head dim.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from serve_tpu.config import ModelConfig, RopeConfig
from serve_tpu.ops.attention import ragged_paged_attention, write_kv


class ModelInputs(NamedTuple):
    """One flat batch; every array is padded to a fixed bucket shape."""

    tokens: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    slots: jax.Array  # i32[T] page * page_size + offset; padding rows write to page 0
    kv_lens: jax.Array  # i32[S]
    page_indices: jax.Array  # i32[S, P]
    cu_q_lens: jax.Array  # i32[S + 1]
    num_seqs: jax.Array  # i32[1]
    logits_indices: jax.Array  # i32[R] rows whose logits are returned (R = S in serving)


def forward(params, kv_pages, inputs: ModelInputs, *, config: ModelConfig, mesh=None):
    """Returns (logits f32[R, V] at inputs.logits_indices, new kv_pages)."""
    x = params["embed"][inputs.tokens]  # [T, E]
    cos, sin = rope_cos_sin(inputs.positions, config.head_dim, config.rope)
    new_pages = []
    for layer, pages in zip(params["layers"], kv_pages):
        h, pages = attention(layer, pages, rms_norm(x, layer["attn_norm"], config.rms_norm_eps),
                             cos, sin, inputs, config, mesh)
        x = x + h
        x = x + mlp(layer, rms_norm(x, layer["mlp_norm"], config.rms_norm_eps))
        new_pages.append(pages)
    x = rms_norm(x[inputs.logits_indices], params["final_norm"], config.rms_norm_eps)  # [R, E]
    lm_head = params["embed"].T if config.is_tied_embedding else params["lm_head"]
    logits = jnp.einsum("re,ev->rv", x, lm_head, preferred_element_type=jnp.float32)
    return logits, new_pages


def attention(layer, pages, x, cos, sin, inputs: ModelInputs, config: ModelConfig, mesh):
    num_tokens, head_dim = x.shape[0], config.head_dim
    q = jnp.einsum("te,ef->tf", x, layer["wq"])  # [T, H*D]
    k = jnp.einsum("te,ef->tf", x, layer["wk"])  # [T, K*D]
    v = jnp.einsum("te,ef->tf", x, layer["wv"])
    if config.is_qkv_bias:
        q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
    q = q.reshape(num_tokens, -1, head_dim)  # [T, H, D]
    k = k.reshape(num_tokens, -1, head_dim)  # [T, K, D]
    v = v.reshape(num_tokens, -1, head_dim)
    if config.is_qk_norm:
        q = rms_norm(q, layer["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, layer["k_norm"], config.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    pages = write_kv(pages, k, v, inputs.slots)
    out = ragged_paged_attention(
        q, pages, inputs.kv_lens, inputs.page_indices, inputs.cu_q_lens, inputs.num_seqs,
        sm_scale=1.0 / math.sqrt(head_dim), mesh=mesh)  # [T, H, D]
    return jnp.einsum("tf,fe->te", out.reshape(num_tokens, -1), layer["wo"]), pages


def mlp(layer, x):
    gate = jnp.einsum("te,ef->tf", x, layer["w_gate"])  # [T, F]
    up = jnp.einsum("te,ef->tf", x, layer["w_up"])
    return jnp.einsum("tf,fe->te", jax.nn.silu(gate) * up, layer["w_down"])  # [T, E]


def rms_norm(x, weight, eps: float):
    """RMSNorm over the last axis, computed in float32 as transformers does."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def rope_cos_sin(positions, head_dim: int, rope: RopeConfig):
    """cos, sin f32[T, D] for the rotate-half convention of Hugging Face checkpoints."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inverse_frequencies(head_dim, rope))
    angles = jnp.concatenate([angles, angles], axis=-1)  # [T, D]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """x [T, N, D] rotated by position; computed in float32."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> np.ndarray:
    """f32[D/2] rotary frequencies, with `linear` or `llama3` scaling applied."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / np.float32(rope.theta) ** exponents).astype(np.float32)
    if rope.type == "linear":
        return inv_freq / np.float32(rope.factor)
    if rope.type != "llama3":
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = rope.original_max_position / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_position / rope.high_freq_factor
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)
