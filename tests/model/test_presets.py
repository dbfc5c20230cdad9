"""`make-model` presets: complete, deterministic Hugging Face directories with a real BPE tokenizer."""

import hashlib
import json

import pytest
from transformers import AutoConfig, AutoTokenizer

from serve_tpu.config import ModelConfig
from serve_tpu.model.presets import PRESETS, make_model
from serve_tpu.model.weights import hf_names, hf_shape, open_safetensors


def digest(model_dir) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


def test_same_preset_gives_same_bytes(tiny_model_dir, tmp_path):
    again = make_model("tiny", tmp_path / "again")
    assert digest(again) == digest(tiny_model_dir)
    assert set(digest(again)) == {"config.json", "generation_config.json", "model.safetensors",
                                  "tokenizer.json", "tokenizer_config.json"}


def test_transformers_reads_config_and_tokenizer(tiny_model_dir):
    config = AutoConfig.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert config.model_type == "llama" and config.vocab_size == len(tokenizer) == 2048
    text = "Hello world, the quick brown fox!"
    ids = tokenizer.encode(text)
    assert ids[0] == 0 and len(ids) < len(text) // 2  # BOS, then real merges (not one id per char)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_chat_template_renders_llama3_format(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_weights_cover_the_config(tiny_model_dir):
    config = ModelConfig.from_pretrained(tiny_model_dir)
    files = open_safetensors(tiny_model_dir)
    names = {name for name in _leaves(hf_names(config))}
    assert names == set(files)
    params = sum(files[n].get(n).size for n in names)
    assert 3_000_000 < params < 4_000_000
    assert config.eos_token_ids == (1, 4)


def test_bench_preset_is_125m_llama():
    spec = PRESETS["bench"]
    config = ModelConfig(
        architecture="llama", vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"], num_layers=spec["num_hidden_layers"],
        num_heads=spec["num_attention_heads"], num_kv_heads=spec["num_key_value_heads"],
        head_dim=spec["head_dim"], rms_norm_eps=1e-5, rope=None, max_position=4096,
        is_tied_embedding=False, is_qkv_bias=False, is_qk_norm=False)
    layer = sum(_size(hf_shape(leaf, config)) for leaf in hf_names(config)["layers"][0])
    total = config.num_layers * layer + 2 * _size(hf_shape("embed", config)) + config.hidden_size
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (768, 12, 12, 4)
    assert 120e6 < total < 130e6


def test_bfloat16_and_bad_arguments(tmp_path):
    out = make_model("tiny", tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert ModelConfig.from_pretrained(out).dtype == "bfloat16"
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        make_model("huge", tmp_path / "x")
    with pytest.raises(ValueError, match="dtype must be float32 or bfloat16, got 'int8'"):
        make_model("tiny", tmp_path / "y", dtype="int8")


def _size(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree
