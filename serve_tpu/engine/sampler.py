"""On-device sampling for one bucket of S rows, each row with its own parameters.

`sample(logits, inputs)` runs inside the jitted step, after the model's logits:
raw log-probs (what the request reports) are taken first, then, in vLLM's order,
logit bias -> repetition penalty -> presence/frequency penalties -> greedy rows take the
argmax -> temperature -> top-k -> top-p -> min-p -> one inverse-CDF draw per row (one
uniform number per row, not one per token). A row's key is folded from (seed, position)
only, so its token depends neither on its neighbours nor on its index in the batch.
Each stage sits in a batch-wide `lax.cond` and is skipped at run time when no row uses it.
Top-k / top-p read their floor from the HEAD_SIZE largest logits (XLA TopK); the full sort
of the vocabulary runs only when some row's k or nucleus reaches past that head.

`build_sampling_inputs` is the host side: it packs `RowSpec`s into fixed-shape numpy
arrays for one bucket; None rows are padding (greedy, nothing on). History is filled only
for rows that use a penalty, so the common case copies no token ids.

Shape letters: S rows, V vocab, M history (max context), B bias entries, L top log-probs.
"""

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from serve_tpu.engine.request import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams

MAX_BIAS = 320  # logit_bias entries plus ids suppressed before min_tokens
MIN_TEMPERATURE = 1e-5  # rows below this are greedy (vLLM's _SAMPLING_EPS)
HEAD_SIZE = 256  # top-k / top-p look at this many largest logits before sorting a whole row
assert MAX_BIAS >= MAX_LOGIT_BIAS + 8


class SamplingInputs(NamedTuple):
    """Per-row parameters; every array has a fixed shape for its bucket of S rows."""

    temperature: jax.Array  # f32[S] 0 = greedy
    top_p: jax.Array  # f32[S] 1 = off
    top_k: jax.Array  # i32[S] 0 = off
    min_p: jax.Array  # f32[S] 0 = off
    seeds: jax.Array  # u32[S, 2] threefry key data: (seed >> 32, seed & 0xffffffff)
    positions: jax.Array  # i32[S] index of the sampled token in the sequence's output
    presence_penalty: jax.Array  # f32[S] 0 = off
    frequency_penalty: jax.Array  # f32[S] 0 = off
    repetition_penalty: jax.Array  # f32[S] 1 = off
    history: jax.Array  # i32[S, M] prompt then output ids, -1 = padding
    is_output: jax.Array  # bool[S, M] which history entries are output tokens
    bias_ids: jax.Array  # i32[S, B] -1 = padding
    bias_values: jax.Array  # f32[S, B] added to the logit of bias_ids (-inf suppresses)


class SampleOutput(NamedTuple):
    tokens: jax.Array  # i32[S]
    logprobs: jax.Array  # f32[S] of the token under the raw model distribution
    top_ids: jax.Array  # i32[S, L] L = min(20, V), best first
    top_logprobs: jax.Array  # f32[S, L]


def sample(logits: jax.Array, inputs: SamplingInputs) -> SampleOutput:
    """logits f32[S, V] -> one token per row with raw log-probs; pure and jittable."""
    logits = logits.astype(jnp.float32)
    raw = jax.nn.log_softmax(logits, axis=-1)  # [S, V]
    processed = process_logits(logits, inputs)  # [S, V]
    is_greedy = inputs.temperature < MIN_TEMPERATURE  # [S]
    greedy = argmax(processed)  # [S]
    tokens = jax.lax.cond(jnp.all(is_greedy), lambda: greedy,
                          lambda: jnp.where(is_greedy, greedy, _draw(processed, greedy, inputs)))
    top_logprobs, top_ids = jax.lax.top_k(raw, min(MAX_TOP_LOGPROBS, logits.shape[-1]))  # [S, L]
    logprobs = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]  # [S]
    return SampleOutput(tokens, logprobs, top_ids.astype(jnp.int32), top_logprobs)


def argmax(logits: jax.Array) -> jax.Array:
    """First index of each row's max, i32[S] (two plain reductions: jnp.argmax's variadic
    reduce is ~3x slower on XLA:CPU)."""
    vocab = logits.shape[-1]
    is_top = logits == jnp.max(logits, axis=-1, keepdims=True)  # [S, V]
    first = jnp.min(jnp.where(is_top, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
    return jnp.minimum(first, vocab - 1)  # a NaN row matches nothing


def process_logits(logits: jax.Array, inputs: SamplingInputs) -> jax.Array:
    """Logit bias, then penalties: the logits greedy rows take the argmax of. [S, V]"""
    has_bias = jnp.any(inputs.bias_ids >= 0)
    logits = jax.lax.cond(has_bias, apply_bias, lambda x, *_: x, logits, inputs.bias_ids, inputs.bias_values)
    has_penalty = jnp.any((inputs.presence_penalty != 0) | (inputs.frequency_penalty != 0)
                          | (inputs.repetition_penalty != 1))
    return jax.lax.cond(has_penalty, apply_penalties, lambda x, *_: x, logits, inputs.history,
                        inputs.is_output, inputs.presence_penalty, inputs.frequency_penalty,
                        inputs.repetition_penalty)


def apply_bias(logits: jax.Array, bias_ids: jax.Array, bias_values: jax.Array) -> jax.Array:
    """Sparse add: logits[s, bias_ids[s, b]] += bias_values[s, b]; ids -1 or >= V are dropped."""
    num_rows, vocab = logits.shape
    ids = jnp.where(bias_ids >= 0, bias_ids, vocab)  # [S, B] padding points past the vocab
    rows = jnp.arange(num_rows)[:, None]  # [S, 1]
    return logits.at[rows, ids].add(bias_values, mode="drop")


def apply_penalties(logits, history, is_output, presence, frequency, repetition) -> jax.Array:
    """vLLM's penalties. Repetition (prompt + output tokens): positive logits are divided by
    it, negative ones multiplied. Then logits -= frequency * count, then presence * (count > 0),
    counting output tokens only. A row with (0, 0, 1) is left exactly as it was."""
    num_rows, vocab = logits.shape
    ids = jnp.where(history >= 0, history, vocab)  # [S, M]
    rows = jnp.arange(num_rows)[:, None]  # [S, 1]
    zeros = jnp.zeros((num_rows, vocab), jnp.float32)
    is_seen = zeros.at[rows, ids].add(1.0, mode="drop") > 0  # [S, V] prompt + output
    counts = zeros.at[rows, ids].add(is_output.astype(jnp.float32), mode="drop")  # [S, V] output only
    penalty = jnp.where(is_seen, repetition[:, None], 1.0)  # [S, V]
    logits = jnp.where(logits > 0, logits / penalty, logits * penalty)
    logits = logits - frequency[:, None] * counts
    return logits - presence[:, None] * (counts > 0)


def _draw(processed: jax.Array, greedy: jax.Array, inputs: SamplingInputs) -> jax.Array:
    """Temperature, filters, then one inverse-CDF draw per row with the row's own key: the
    first token whose cumulative weight exceeds u * total weight. i32[S]"""
    temperature = jnp.maximum(inputs.temperature, MIN_TEMPERATURE)  # greedy rows: no NaN, unused
    scaled = filter_logits(processed / temperature[:, None], inputs)  # [S, V]
    weights = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))  # [S, V] dropped tokens 0
    cdf = jnp.cumsum(weights, axis=-1)  # [S, V] nondecreasing
    keys = jax.vmap(row_key)(inputs.seeds, inputs.positions)  # [S] keys
    target = jax.vmap(jax.random.uniform)(keys) * cdf[:, -1]  # [S] in [0, total)
    index = jnp.sum(cdf <= target[:, None], axis=-1, dtype=jnp.int32)  # [S] weight there is > 0
    return jnp.where(index < scaled.shape[-1], index, greedy)  # u * total rounded up to total


def row_key(seed: jax.Array, position: jax.Array) -> jax.Array:
    """The key of one row: from its seed (u32[2]) and output position only."""
    return jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), position)


def filter_logits(scaled: jax.Array, inputs: SamplingInputs) -> jax.Array:
    """top-k, then top-p, then min-p on temperature-scaled logits; dropped tokens get -inf."""
    is_top = jnp.any((inputs.top_k > 0) | (inputs.top_p < 1))
    scaled = jax.lax.cond(is_top, apply_top_k_top_p, lambda x, *_: x, scaled, inputs.top_k, inputs.top_p)
    return jax.lax.cond(jnp.any(inputs.min_p > 0), apply_min_p, lambda x, _: x, scaled, inputs.min_p)


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Keeps the k largest logits (0 = all), then the smallest set of those whose probability
    sums to >= p (1 = all); ties at the floor are kept. The floor is read from the HEAD_SIZE
    largest logits of each row; the whole vocabulary is sorted only when a row's k or nucleus
    reaches past them."""
    head = jax.lax.top_k(logits, min(HEAD_SIZE, logits.shape[-1]))[0]  # [S, H] descending
    floor, is_found = _floor(head, logits, top_k, top_p)  # [S]
    floor = jax.lax.cond(jnp.all(is_found), lambda: floor, lambda: jnp.where(
        is_found, floor, _floor(_sort_descending(logits), logits, top_k, top_p)[0]))
    return jnp.where(logits >= floor[:, None], logits, -jnp.inf)


def _floor(ordered: jax.Array, logits: jax.Array, top_k: jax.Array, top_p: jax.Array):
    """(floor f32[S], is_found bool[S]) from `ordered`, a descending prefix [S, N] of each row
    of `logits` [S, V]; is_found is False where the prefix is too short to hold the floor."""
    num = ordered.shape[-1]
    k_index = jnp.clip(top_k - 1, 0, num - 1)[:, None]  # [S, 1]
    k_floor = jnp.where(top_k > 0, jnp.take_along_axis(ordered, k_index, axis=-1)[:, 0], -jnp.inf)  # [S]
    top = jnp.max(ordered, axis=-1, keepdims=True)  # [S, 1] (a slice here defeats XLA:CPU TopK)
    total = jnp.sum(jnp.where(logits >= k_floor[:, None], jnp.exp(logits - top), 0.0), axis=-1)  # [S]
    mass = jnp.cumsum(jnp.where(ordered >= k_floor[:, None], jnp.exp(ordered - top), 0.0), axis=-1)  # [S, N]
    target = top_p * total  # [S] nucleus mass, unnormalised
    num_keep = 1 + jnp.sum(mass[:, :-1] < target[:, None], axis=-1)  # [S] tokens ranked above fall short
    p_floor = jnp.take_along_axis(ordered, num_keep[:, None] - 1, axis=-1)[:, 0]  # [S]
    p_floor = jnp.where(top_p < 1, p_floor, -jnp.inf)
    is_found = (top_k <= num) & ((top_p >= 1) | (mass[:, -1] >= target))
    return jnp.maximum(k_floor, p_floor), is_found


def _sort_descending(logits: jax.Array) -> jax.Array:
    """Full descending sort of each row [S, V]. Sorts the floats' bits as int32 (order kept):
    ~4x faster on XLA:CPU than a float sort, whose comparator handles NaN."""
    bits = jax.lax.bitcast_convert_type(logits, jnp.int32)
    keys = jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # [S, V] same order as the floats
    keys = jnp.flip(jax.lax.sort(keys, dimension=1, is_stable=False), axis=1)
    return jax.lax.bitcast_convert_type(jnp.where(keys < 0, keys ^ 0x7FFFFFFF, keys), jnp.float32)


def apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Drops tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p)."""
    floor = jnp.max(logits, axis=-1) + jnp.log(min_p)  # [S] min_p 0 gives -inf: keeps all
    return jnp.where(logits >= floor[:, None], logits, -jnp.inf)


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """One sequence's row, as the engine knows it on the host."""

    params: SamplingParams
    seed: int  # resolved by the engine, one per sequence, in [0, 2**64)
    position: int  # index of the token being sampled in the output (len(output_ids) when decoding)
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    suppressed_ids: Sequence[int] = ()  # e.g. EOS and stop ids before min_tokens: bias -inf


def build_sampling_inputs(rows: Sequence[RowSpec | None], num_rows: int, history_len: int) -> SamplingInputs:
    """Numpy arrays for a bucket of `num_rows` rows; rows[i] None (or i >= len(rows)) is padding."""
    assert len(rows) <= num_rows, (len(rows), num_rows)
    arrays = _padding_arrays(num_rows, history_len)
    for index, row in enumerate(rows):
        if row is not None:
            _fill_row(arrays, index, row)
    return SamplingInputs(**arrays)


def _padding_arrays(num_rows: int, history_len: int) -> dict[str, np.ndarray]:
    rows, history = (num_rows,), (num_rows, history_len)
    return dict(
        temperature=np.zeros(rows, np.float32), top_p=np.ones(rows, np.float32),
        top_k=np.zeros(rows, np.int32), min_p=np.zeros(rows, np.float32),
        seeds=np.zeros((num_rows, 2), np.uint32), positions=np.zeros(rows, np.int32),
        presence_penalty=np.zeros(rows, np.float32), frequency_penalty=np.zeros(rows, np.float32),
        repetition_penalty=np.ones(rows, np.float32),
        history=np.full(history, -1, np.int32), is_output=np.zeros(history, np.bool_),
        bias_ids=np.full((num_rows, MAX_BIAS), -1, np.int32),
        bias_values=np.zeros((num_rows, MAX_BIAS), np.float32))


def _fill_row(arrays: dict[str, np.ndarray], index: int, row: RowSpec) -> None:
    p = row.params
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        arrays[name][index] = getattr(p, name)
    arrays["seeds"][index] = (row.seed >> 32) & 0xFFFFFFFF, row.seed & 0xFFFFFFFF
    arrays["positions"][index] = row.position
    if p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1:
        num_prompt, num_output = len(row.prompt_ids), len(row.output_ids)
        assert num_prompt + num_output <= arrays["history"].shape[1], (num_prompt, num_output)
        arrays["history"][index, :num_prompt] = row.prompt_ids
        arrays["history"][index, num_prompt:num_prompt + num_output] = row.output_ids
        arrays["is_output"][index, num_prompt:num_prompt + num_output] = True
    num_bias, num_suppressed = len(p.logit_bias), len(row.suppressed_ids)
    if num_bias + num_suppressed > MAX_BIAS:
        raise ValueError(f"{num_bias} logit_bias entries and {num_suppressed} suppressed ids "
                         f"exceed MAX_BIAS ({MAX_BIAS})")
    if num_bias:
        arrays["bias_ids"][index, :num_bias], arrays["bias_values"][index, :num_bias] = zip(*p.logit_bias)
    arrays["bias_ids"][index, num_bias:num_bias + num_suppressed] = row.suppressed_ids
    arrays["bias_values"][index, num_bias:num_bias + num_suppressed] = -np.inf
