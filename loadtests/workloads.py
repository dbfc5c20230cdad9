"""Workloads: seeded lists of `Prompt`s (text, exact token count, output length) to send.

Three sources, each a pure function of its arguments and a seed:
- `random_prompts`: random token ids with fixed or uniformly distributed input/output lengths;
- `sharegpt_prompts`: the first human turn (and reply length) of conversations in a ShareGPT
  JSON file;
- `shared_prefix_prompts`: groups of prompts that share a long random prefix, to show prefix
  caching.

Exact input lengths. Random ids decoded to text do not always encode back to the same number
of ids (byte pieces merge, words split). Ids are drawn only from tokens that decode alone to
whole characters and encode back to themselves (`_normal_ids`); then, like vLLM,
`_text_of_length` decodes, re-encodes, and truncates or pads with fresh random ids until the
round trip gives exactly the target length (up to `MAX_RETRIES` rounds). A prompt that still
misses keeps its measured length in `Prompt.num_prompt_tokens`, so the counts reported are
always what the tokenizer says of the text that is sent.
Counts are of the prompt text alone, without special tokens or a chat template.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAX_RETRIES = 10
MIN_CLEAN_IDS = 100  # fewer ids that round-trip alone: draw from all ordinary ids instead
SHAREGPT_MIN_TOKENS = 4  # vLLM's filters for ShareGPT: drop very short and very long turns
SHAREGPT_MAX_PROMPT_TOKENS = 1024
SHAREGPT_MAX_TOTAL_TOKENS = 2048


@dataclass(frozen=True)
class Prompt:
    text: str
    num_prompt_tokens: int
    max_tokens: int


def load_tokenizer(path):
    """A Hugging Face tokenizer from a local directory (no network)."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise FileNotFoundError(f"tokenizer directory {str(path)!r} does not exist")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def lengths(mean: int, range_ratio: float, num: int, rng: np.random.Generator) -> np.ndarray:
    """`num` lengths uniform on [mean*(1-r), mean*(1+r)] (all `mean` when r = 0), each >= 1."""
    if mean < 1:
        raise ValueError(f"length must be >= 1, got {mean}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    low, high = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return np.maximum(rng.integers(low, high + 1, size=num), 1)


def random_prompts(tokenizer, num_prompts: int, input_len: int, output_len: int,
                   range_ratio: float = 0.0, seed: int = 0) -> list[Prompt]:
    """Prompts of random tokens; input and output lengths drawn by `lengths`."""
    _check_count(num_prompts)
    rng = np.random.default_rng(seed)
    input_lens = lengths(input_len, range_ratio, num_prompts, rng)
    output_lens = lengths(output_len, range_ratio, num_prompts, rng)
    ids = _normal_ids(tokenizer)
    return [_random_prompt(tokenizer, ids, int(n_in), int(n_out), rng)
            for n_in, n_out in zip(input_lens, output_lens)]


def shared_prefix_prompts(tokenizer, num_prompts: int, num_prefixes: int, prefix_len: int,
                          input_len: int, output_len: int, seed: int = 0) -> list[Prompt]:
    """`num_prefixes` random prefixes of `prefix_len` tokens, each followed by random suffixes
    of `input_len` tokens; prompt i uses prefix i % num_prefixes, so groups interleave."""
    _check_count(num_prompts)
    if num_prefixes < 1 or prefix_len < 1:
        raise ValueError(f"num_prefixes and prefix_len must be >= 1, got {num_prefixes}, {prefix_len}")
    rng = np.random.default_rng(seed)
    ids = _normal_ids(tokenizer)
    prefixes = [_text_of_length(tokenizer, ids, prefix_len, rng)[0] for _ in range(num_prefixes)]
    prompts = []
    for i in range(num_prompts):
        suffix, _ = _text_of_length(tokenizer, ids, input_len, rng)
        text = prefixes[i % num_prefixes] + suffix
        prompts.append(Prompt(text, count_tokens(tokenizer, text), output_len))
    return prompts


def sharegpt_prompts(tokenizer, path, num_prompts: int, output_len: int | None = None,
                     seed: int = 0) -> list[Prompt]:
    """First prompt/reply pairs of a ShareGPT JSON file, shuffled by `seed`. The output length
    is the reply's token count unless `output_len` fixes it. Conversations may use
    {"from", "value"} or {"role", "content"} turns, under "conversations" or "messages"."""
    _check_count(num_prompts)
    pairs = _sharegpt_pairs(path)
    order = np.random.default_rng(seed).permutation(len(pairs))
    prompts = []
    for i in order:
        prompt = _sharegpt_prompt(tokenizer, *pairs[i], output_len)
        if prompt is not None:
            prompts.append(prompt)
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise ValueError(f"no usable conversations in ShareGPT file {str(path)!r}")
    return prompts


def _sharegpt_pairs(path) -> list[tuple[str, str]]:
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"ShareGPT file {str(path)!r} is not JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"ShareGPT file {str(path)!r} must hold a JSON list of conversations")
    pairs = []
    for item in data:
        if not isinstance(item, dict):
            continue
        turns = item.get("conversations") or item.get("messages") or []
        texts = [t.get("value", t.get("content")) for t in turns[:2] if isinstance(t, dict)]
        if len(texts) == 2 and all(isinstance(t, str) for t in texts):
            pairs.append((texts[0], texts[1]))
    return pairs


def _sharegpt_prompt(tokenizer, text: str, reply: str, output_len: int | None) -> Prompt | None:
    num_prompt_tokens = count_tokens(tokenizer, text)
    num_output = output_len or count_tokens(tokenizer, reply)
    if num_prompt_tokens < SHAREGPT_MIN_TOKENS or num_output < SHAREGPT_MIN_TOKENS:
        return None
    if num_prompt_tokens > SHAREGPT_MAX_PROMPT_TOKENS:
        return None
    if num_prompt_tokens + num_output > SHAREGPT_MAX_TOTAL_TOKENS:
        return None
    return Prompt(text, num_prompt_tokens, num_output)


def _random_prompt(tokenizer, ids: np.ndarray, input_len: int, output_len: int,
                   rng: np.random.Generator) -> Prompt:
    text, num_tokens = _text_of_length(tokenizer, ids, input_len, rng)
    return Prompt(text, num_tokens, output_len)


def _text_of_length(tokenizer, ids: np.ndarray, target: int,
                    rng: np.random.Generator) -> tuple[str, int]:
    """Text that encodes to `target` ids when possible; returns it with its true length."""
    tokens = rng.choice(ids, size=target).tolist()
    for _ in range(MAX_RETRIES):
        text = tokenizer.decode(tokens)
        tokens = tokenizer.encode(text, add_special_tokens=False)
        if len(tokens) == target:
            return text, target
        if len(tokens) > target:
            tokens = tokens[:target]
        else:
            tokens = tokens + rng.choice(ids, size=target - len(tokens)).tolist()
    text = tokenizer.decode(tokens)
    return text, count_tokens(tokenizer, text)


def _normal_ids(tokenizer) -> np.ndarray:
    """Ids to draw random prompts from: not special or added tokens, and, where the tokenizer
    has enough of them, ids that decode alone to whole characters and encode back to
    themselves (byte fragments and such make the decode/encode round trip miss its length)."""
    excluded = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    ids = [i for i in range(len(tokenizer)) if i not in excluded]
    if not ids:
        raise ValueError("the tokenizer has no ordinary (non-special) tokens")
    pieces = tokenizer.batch_decode([[i] for i in ids])
    encoded = tokenizer(pieces, add_special_tokens=False)["input_ids"]
    clean = [i for i, piece, back in zip(ids, pieces, encoded)
             if "\ufffd" not in piece and back == [i]]
    return np.array(clean if len(clean) >= MIN_CLEAN_IDS else ids)


def _check_count(num_prompts: int) -> None:
    if num_prompts < 1:
        raise ValueError(f"number of prompts must be >= 1, got {num_prompts}")
