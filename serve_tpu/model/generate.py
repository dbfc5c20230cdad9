"""Offline generation for one prompt: model loading, a paged cache, prefill then decode.

The small direct path behind `serve-tpu generate` and the model tests: one sequence owns
pages 1..P of the cache (page 0 is the scratch page padding rows write to). The engine
(continuous batching over many requests) builds the same `ModelInputs` for many sequences.
"""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from serve_tpu import sharding
from serve_tpu.config import MeshConfig, ModelConfig
from serve_tpu.model.llama import ModelInputs, forward
from serve_tpu.model.weights import load_params


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict
    mesh: jax.sharding.Mesh
    dtype: jnp.dtype

    @classmethod
    def load(cls, model_dir, mesh_config: MeshConfig = MeshConfig(), dtype=None, devices=None):
        """dtype None: bfloat16 on TPU, float32 elsewhere (bf16 dots are slow on CPU)."""
        config = ModelConfig.from_pretrained(model_dir)
        mesh = sharding.make_mesh(mesh_config, devices)
        if dtype is None:
            dtype = jnp.bfloat16 if mesh.devices.flat[0].platform == "tpu" else jnp.float32
        return cls(config, load_params(model_dir, config, mesh, dtype), mesh, jnp.dtype(dtype))


def init_kv_pages(model: LoadedModel, num_pages: int, page_size: int) -> list[jax.Array]:
    """Zeroed cache, one [num_pages, page_size, 2K, D] array per layer, split on heads."""
    num_kv = sharding.num_cache_kv_heads(model.config, sharding.tp_size(model.mesh))
    shape = (num_pages, page_size, 2 * num_kv, model.config.head_dim)
    zeros = jax.jit(lambda: jnp.zeros(shape, model.dtype), out_shardings=sharding.kv_cache_sharding(model.mesh))
    return [zeros() for _ in range(model.config.num_layers)]


def make_step(model: LoadedModel):
    """Jitted forward with the cache donated: (params, kv_pages, inputs) -> (logits, kv_pages)."""
    return jax.jit(functools.partial(forward, config=model.config, mesh=model.mesh), donate_argnums=(1,))


def build_inputs(chunks, num_rows: int, max_seqs: int, pages_per_seq: int, page_size: int) -> ModelInputs:
    """Flat batch of `chunks` = [(tokens, start, pages)]: each sequence's new tokens at
    positions start.., its pages in order; padded to `num_rows` rows and `max_seqs` sequences.
    Logits are returned for the last new token of each sequence."""
    num_tokens = sum(len(chunk) for chunk, _, _ in chunks)
    if num_tokens > num_rows or len(chunks) > max_seqs:
        raise ValueError(f"{num_tokens} tokens in {len(chunks)} sequences exceed the bucket "
                         f"of {num_rows} rows and {max_seqs} sequences")
    tokens, positions = np.zeros(num_rows, np.int32), np.zeros(num_rows, np.int32)
    slots = np.zeros(num_rows, np.int32)  # padding rows write into scratch page 0
    kv_lens, logits_indices = np.zeros(max_seqs, np.int32), np.zeros(max_seqs, np.int32)
    page_indices = np.zeros((max_seqs, pages_per_seq), np.int32)
    cu_q_lens = np.zeros(max_seqs + 1, np.int32)
    row = 0
    for s, (chunk, start, pages) in enumerate(chunks):
        n, pages = len(chunk), np.asarray(pages, np.int32)
        pos = np.arange(start, start + n, dtype=np.int32)
        tokens[row:row + n], positions[row:row + n] = chunk, pos
        slots[row:row + n] = pages[pos // page_size] * page_size + pos % page_size
        kv_lens[s], page_indices[s, :len(pages)] = start + n, pages
        row += n
        cu_q_lens[s + 1:], logits_indices[s] = row, row - 1
    return ModelInputs(tokens, positions, slots, kv_lens, page_indices, cu_q_lens,
                       np.array([len(chunks)], np.int32), logits_indices)


def generate(model: LoadedModel, prompt_ids, max_tokens: int, temperature: float = 0.0,
             seed: int = 0, page_size: int = 16, stop_ids=(), stats: dict | None = None) -> list[int]:
    """Prefill the prompt in one step, then decode one token per step; returns new token ids."""
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    total = len(prompt_ids) + max_tokens
    if total > model.config.max_position:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_tokens ({max_tokens}) exceeds "
                         f"the model's context of {model.config.max_position} tokens")
    num_pages = -(-total // page_size)
    pages = np.arange(1, num_pages + 1, dtype=np.int32)
    kv_pages = init_kv_pages(model, num_pages + 1, page_size)
    step = make_step(model)
    prefill_rows = max(16, 1 << (len(prompt_ids) - 1).bit_length())
    inputs = build_inputs([(prompt_ids, 0, pages)], prefill_rows, 1, num_pages, page_size)
    out, times = [], [time.perf_counter()]
    logits, kv_pages = step(model.params, kv_pages, inputs)
    for i in range(max_tokens):
        out.append(_sample(logits[0], temperature, seed, len(prompt_ids) + i))
        times.append(time.perf_counter())
        if out[-1] in stop_ids or i == max_tokens - 1:
            break
        inputs = build_inputs([(out[-1:], len(prompt_ids) + i, pages)], 1, 1, num_pages, page_size)
        logits, kv_pages = step(model.params, kv_pages, inputs)
    if stats is not None:  # step times; the first of each shape includes its compilation
        stats.update(prefill_s=times[1] - times[0], decode_step_s=list(np.diff(times[1:])))
    return out


def _sample(logits, temperature: float, seed: int, position: int) -> int:
    if temperature == 0.0:
        return int(jnp.argmax(logits))
    key = jax.random.fold_in(jax.random.key(seed), position)
    return int(jax.random.categorical(key, logits / temperature))
