"""Generators of complete, deterministic Hugging Face model directories (`serve-tpu make-model`).

A preset is a Llama config plus seeded random weights and a real byte-level BPE tokenizer
trained (with the `tokenizers` library) on an embedded English corpus stretched with seeded
synthetic words. Ids the trained merges do not reach are filled with reserved special
tokens, as Llama 3 does, so every model id decodes. Same preset, same bytes.
"""

import json
from pathlib import Path

import numpy as np

PRESETS = {
    # ~3.4 M params: tests and the embedded default. 8 heads so tp=8 splits them.
    "tiny": dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                 max_position_embeddings=2048, rope_theta=500000.0, rope_scaling=None),
    # ~125 M params: benchmarks (Llama 3 shape at small width).
    "bench": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, head_dim=64, tie_word_embeddings=False,
                  max_position_embeddings=16384, rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"]
BOS_ID, EOS_ID, EOT_ID = 0, 1, 4
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CORPUS = """\
The quick brown fox jumps over the lazy dog. A tensor processing unit is a chip built to
multiply matrices. Large language models answer questions, write code and summarise text.
Serving a model means turning many requests into batches, one step at a time, and sending the
tokens back as soon as they are made. Each request has a prompt; the prompt is split into
tokens, and every token has a key and a value that the model keeps in a cache of pages.
When the cache is full, a request may wait, or be preempted and computed again later.
Hello! How are you today? I am fine, thank you. What is the capital of France? Paris is the
capital of France. Tell me a story about a robot who learned to paint. Once upon a time, in a
small town by the sea, there lived a robot named Ada. She liked the colours of the morning.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2026. Code: def add(a, b): return a + b.
{"name": "value", "list": [1, 2, 3]} <html><body>text</body></html> x = y * (z + 1);
Questions, answers, lists; quotes "like this" and 'like that' - dashes, colons: and more.
"""


def make_model(preset: str, out_dir, dtype: str = "float32") -> Path:
    """Write config.json, model.safetensors, tokenizer files for `preset` into out_dir."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = PRESETS[preset]
    _write_tokenizer(out, spec["vocab_size"], seed=len(preset))
    _write_json(out / "config.json", _config(spec, dtype))
    _write_json(out / "generation_config.json",
                {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, EOT_ID], "do_sample": False})
    _write_weights(out / "model.safetensors", spec, dtype, seed=sum(map(ord, preset)))
    return out


def _config(spec: dict, dtype: str) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "attention_bias": False, "mlp_bias": False,
            "bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, EOT_ID], "torch_dtype": dtype, **spec}


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _synthetic_text(seed: int, num_words: int = 60000) -> str:
    """Seeded pseudo-English: real words from the corpus mixed with made-up syllable words."""
    rng = np.random.default_rng(seed)
    words = sorted(set(CORPUS.split()))
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in ["a", "e", "i", "o", "u", "ai", "ou"]]
    made_up = ["".join(rng.choice(syllables, size=rng.integers(1, 4))) for _ in range(6000)]
    vocab = words + made_up
    picks = rng.choice(len(vocab), size=num_words, p=_zipf(len(vocab)))
    return " ".join(vocab[i] for i in picks)


def _zipf(n: int) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1)
    return weights / weights.sum()


def _write_tokenizer(out: Path, vocab_size: int, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS] * 20 + [_synthetic_text(seed)], trainer=trainer)
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(vocab_size - tok.get_vocab_size())]
    tok.add_special_tokens(reserved)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
        special_tokens=[("<|begin_of_text|>", BOS_ID)])
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOT_ID], "pad_token": SPECIAL_TOKENS[EOS_ID],
        "model_max_length": 2048, "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE})


def _write_weights(path: Path, spec: dict, dtype: str, seed: int) -> None:
    import ml_dtypes
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    target = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    tensors = {name: value.astype(target) for name, value in _random_tensors(spec, rng)}
    save_file(tensors, str(path), metadata={"format": "pt"})


def _random_tensors(spec: dict, rng):
    """(Hugging Face name, float32 array) for every weight of the preset, in a fixed order."""
    e, f = spec["hidden_size"], spec["intermediate_size"]
    q, kv = spec["num_attention_heads"] * spec["head_dim"], spec["num_key_value_heads"] * spec["head_dim"]

    def normal(*shape):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)

    yield "model.embed_tokens.weight", normal(spec["vocab_size"], e)
    for i in range(spec["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", np.ones(e, np.float32)
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            yield p + f"self_attn.{name}_proj.weight", normal(rows, e)
        yield p + "self_attn.o_proj.weight", normal(e, q)
        yield p + "post_attention_layernorm.weight", np.ones(e, np.float32)
        yield p + "mlp.gate_proj.weight", normal(f, e)
        yield p + "mlp.up_proj.weight", normal(f, e)
        yield p + "mlp.down_proj.weight", normal(e, f)
    yield "model.norm.weight", np.ones(e, np.float32)
    if not spec["tie_word_embeddings"]:
        yield "lm_head.weight", normal(spec["vocab_size"], e)
