"""Weight loading: orbax round trips, damaged or mismatched files, shardings, dtypes.

A checkpoint written by `serve-tpu convert` must load to exactly the arrays (and logits)
the Hugging Face directory gives, at tp=1 and at a tp that repeats KV heads. Damaged
inputs (copies of the fixtures under tmp_path) must fail with an error naming the bad
file, tensor or config value. Loaded models are shared by the tests of this module.
"""

import functools
import json
import re
import shutil
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from serve_tpu import cli, sharding
from serve_tpu.config import MeshConfig, UnsupportedModelError
from serve_tpu.model.generate import LoadedModel, init_kv_pages
from serve_tpu.model.weights import ORBAX_SUBDIR, SafetensorsFile, WeightsError, param_shape
from tests.conftest import FIXTURES
from tests.model.test_parity import full_logits

TINY_PROMPT = [0, 17, 250, 3, 999, 42, 1500, 7, 8, 9, 300, 301, 302, 2000, 11, 12, 13, 14, 15,
               16, 5, 1024, 2047, 33, 64, 128, 256, 512, 77, 88, 99, 100, 101, 1999, 4, 6, 10]
# bf16 compute vs float32 on the same (bf16-stored) weights, logits of std ~2 and |x| <= 8.5:
# max error seen 0.125, mean 0.018.
BF16_LOGITS_ATOL, BF16_LOGITS_MEAN_ERROR = 0.25, 0.03

# A failed orbax restore leaves tensorstore reads running; they finish on orbax's closed event
# loop, or as suspended coroutines, a little after the test that made them (it is not ours).
pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. (None|<coroutine object _read_array_index_and_device_put)"
    ":pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir):
    fixtures = {name: FIXTURES / "models" / name for name in ("llama_gqa_rope3", "qwen3_qknorm")}
    return {**fixtures, "tiny": tiny_model_dir}


@pytest.fixture(scope="module")
def prompts(model_dirs):
    gold = {name: np.load(d / "golden.npz")["prompt_1"].tolist()
            for name, d in model_dirs.items() if name != "tiny"}
    return {**gold, "tiny": TINY_PROMPT}


@pytest.fixture(scope="module")
def converted(model_dirs, tmp_path_factory):
    """name -> directory written by `serve-tpu convert` (converted once per module)."""
    root = tmp_path_factory.mktemp("converted")

    @functools.cache
    def convert(name):
        out = root / name
        assert cli.main(["convert", str(model_dirs[name]), str(out)]) == 0
        assert (out / ORBAX_SUBDIR).is_dir() and not list(out.glob("*.safetensors"))
        return out

    return convert


@pytest.fixture(scope="module")
def load():
    """(model_dir, tp, dtype=float32) -> LoadedModel, loaded once per module."""
    cached = functools.cache(
        lambda model_dir, tp, dtype: LoadedModel.load(model_dir, MeshConfig(tp=tp), dtype=dtype))
    return lambda model_dir, tp, dtype=jnp.float32: cached(model_dir, tp, jnp.dtype(dtype))


@pytest.fixture(scope="module")
def logits(load, prompts):
    """(name, model_dir, tp, dtype=float32) -> logits at every position of that model's prompt."""
    cached = functools.cache(
        lambda name, model_dir, tp, dtype: full_logits(load(model_dir, tp, dtype), prompts[name]))
    return lambda name, model_dir, tp, dtype=jnp.float32: cached(name, model_dir, tp, jnp.dtype(dtype))


def assert_params_identical(got, expected):
    """Same tree, and per leaf the same shape, dtype, sharding and bits."""
    got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(got)
    expected_leaves, expected_tree = jax.tree_util.tree_flatten_with_path(expected)
    assert got_tree == expected_tree
    for (path, x), (_, y) in zip(got_leaves, expected_leaves):
        name = jax.tree_util.keystr(path)
        assert (x.shape, x.dtype, x.sharding.spec) == (y.shape, y.dtype, y.sharding.spec), name
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


@pytest.mark.parametrize("name, tp", [("llama_gqa_rope3", 1), ("llama_gqa_rope3", 4),
                                      ("tiny", 1), ("tiny", 8)])
def test_orbax_round_trip_is_exact(model_dirs, converted, load, logits, name, tp):
    hf, restored = load(model_dirs[name], tp), load(converted(name), tp)
    is_repeated = sharding.num_cache_kv_heads(hf.config, tp) > hf.config.num_kv_heads
    assert is_repeated == (tp > 1)
    assert_params_identical(restored.params, hf.params)
    np.testing.assert_array_equal(logits(name, converted(name), tp), logits(name, model_dirs[name], tp))


def test_convert_keeps_bfloat16_and_restores_as_float32(model_dirs, converted, load, logits):
    import orbax.checkpoint as ocp

    out = converted("qwen3_qknorm")
    config = load(model_dirs["qwen3_qknorm"], 1).config
    assert config.dtype == "bfloat16"
    with ocp.StandardCheckpointer() as ckpt:
        stored = ckpt.metadata(out / ORBAX_SUBDIR).item_metadata.tree
    for path, meta in jax.tree_util.tree_leaves_with_path(stored):
        assert (meta.dtype, meta.shape) == (jnp.bfloat16, param_shape(path[-1].key, config)), path
    restored = load(out, 1)
    assert {x.dtype for x in jax.tree_util.tree_leaves(restored.params)} == {jnp.dtype(jnp.float32)}
    assert_params_identical(restored.params, load(model_dirs["qwen3_qknorm"], 1).params)
    np.testing.assert_array_equal(logits("qwen3_qknorm", out, 1),
                                  logits("qwen3_qknorm", model_dirs["qwen3_qknorm"], 1))


def test_bfloat16_load_keeps_bfloat16(model_dirs, converted, load, logits):
    hf_dir = model_dirs["qwen3_qknorm"]
    model = load(hf_dir, 1, jnp.bfloat16)
    assert {x.dtype for x in jax.tree_util.tree_leaves(model.params)} == {jnp.dtype(jnp.bfloat16)}
    assert all(x.dtype == jnp.bfloat16 for x in init_kv_pages(model, 2, 16))
    assert_params_identical(load(converted("qwen3_qknorm"), 1, jnp.bfloat16).params, model.params)
    stored = load_file(str(hf_dir / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"]
    np.testing.assert_array_equal(np.asarray(model.params["layers"][1]["w_down"]), stored.T)
    f32 = logits("qwen3_qknorm", hf_dir, 1)
    bf16 = logits("qwen3_qknorm", hf_dir, 1, jnp.bfloat16)
    assert bf16.dtype == np.float32 and not np.array_equal(bf16, f32)  # really computed in bf16
    np.testing.assert_allclose(bf16, f32, atol=BF16_LOGITS_ATOL, rtol=0)
    assert np.mean(np.abs(bf16 - f32)) < BF16_LOGITS_MEAN_ERROR


@pytest.mark.parametrize("source", ["hf", "orbax"])
def test_tp8_shardings_and_repeated_kv_heads(model_dirs, converted, load, source):
    """tiny has 2 KV heads: at tp=8 each device holds one copy of KV head device // 4."""
    model = load(model_dirs["tiny"] if source == "hf" else converted("tiny"), 8)
    params, mesh, head_dim = model.params, model.mesh, model.config.head_dim
    layer = params["layers"][0]
    assert layer["wq"].sharding.spec == P(None, "model")
    assert layer["wo"].sharding.spec == P("model", None)
    assert params["embed"].sharding.spec == P(None, "model")
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        assert x.sharding.mesh == mesh and x.sharding.spec == sharding.param_sharding(mesh, path[-1].key).spec
    hf = load_file(str(model_dirs["tiny"] / "model.safetensors"))
    for leaf, proj in (("wk", "k_proj"), ("wv", "v_proj")):
        x = params["layers"][3][leaf]
        assert x.shape == (256, 8 * head_dim)
        source_rows = hf[f"model.layers.3.self_attn.{proj}.weight"]  # [2 * D, E]
        for shard in x.addressable_shards:
            device = shard.index[1].start // head_dim
            assert shard.data.shape == (256, head_dim) and shard.device == mesh.devices[device]
            head = device // 4
            np.testing.assert_array_equal(np.asarray(shard.data),
                                          source_rows[head * head_dim:(head + 1) * head_dim].T)
    pages = init_kv_pages(model, 3, 16)
    assert len(pages) == model.config.num_layers
    for x in pages:
        assert x.shape == (3, 16, 2 * 8, head_dim) and x.sharding.spec == P(None, None, "model", None)
        assert {s.data.shape for s in x.addressable_shards} == {(3, 16, 2, head_dim)}


# --- damaged and unsupported inputs (copies under tmp_path) ---


def copy_fixture(name, tmp_path):
    return shutil.copytree(FIXTURES / "models" / name, tmp_path / name)


def load_tp1(model_dir):
    return LoadedModel.load(model_dir, MeshConfig(tp=1))


def truncate_data_files(ckpt):
    for path in ckpt.rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


DAMAGES = {
    "emptied": lambda ckpt: [shutil.rmtree(ckpt), ckpt.mkdir()],
    "data files truncated": truncate_data_files,
    "garbage manifest": lambda ckpt: (ckpt / "manifest.ocdbt").write_bytes(b"garbage"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_orbax_checkpoint(tmp_path, converted, damage):
    model_dir = shutil.copytree(converted("llama_gqa_rope3"), tmp_path / "converted")
    DAMAGES[damage](model_dir / ORBAX_SUBDIR)
    with pytest.raises(WeightsError, match=re.escape(str(model_dir / ORBAX_SUBDIR))):
        load_tp1(model_dir)


def test_missing_shard_is_named(tmp_path):
    model_dir = copy_fixture("llama_tied_sharded", tmp_path)
    (model_dir / "model-00003-of-00004.safetensors").unlink()
    with pytest.raises(WeightsError, match=r"model-00003-of-00004\.safetensors.*is missing"):
        load_tp1(model_dir)


@pytest.mark.parametrize("name, file", [("llama_gqa_rope3", "model.safetensors"),
                                        ("llama_tied_sharded", "model-00002-of-00004.safetensors")])
def test_truncated_file_is_named(tmp_path, name, file):
    path = copy_fixture(name, tmp_path) / file
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(WeightsError, match=re.escape(str(path)) + ".*truncated"):
        load_tp1(path.parent)


def header(obj) -> bytes:
    text = json.dumps(obj).encode()
    return struct.pack("<Q", len(text)) + text


BAD_HEADERS = {
    "random bytes": np.random.default_rng(0).bytes(4096),
    "empty file": b"",
    "shorter than the length prefix": b"\x10\x00\x00",
    "json cut short": header({"a": 1})[:-3] + b"   ",
    "not utf-8": struct.pack("<Q", 4) + b"\xff\xfe\xfd\xfc",
    "not an object": header([1, 2]),
    "entry without data_offsets": header({"a": {"dtype": "F32", "shape": [2]}}) + bytes(8),
    "shape not a list": header({"a": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}}) + bytes(8),
    "negative offsets": header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}) + bytes(8),
}


@pytest.mark.parametrize("content", list(BAD_HEADERS.values()), ids=list(BAD_HEADERS))
def test_garbage_header_is_named(tmp_path, content):
    path = copy_fixture("llama_tied_sharded", tmp_path) / "model-00004-of-00004.safetensors"
    path.write_bytes(content)
    with pytest.raises(WeightsError, match=re.escape(str(path))):
        SafetensorsFile(path).get("a")
    with pytest.raises(WeightsError, match=re.escape(str(path))):
        load_tp1(path.parent)


def rewrite_tensors(model_dir, edit):
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    model_dir = copy_fixture("llama_gqa_rope3", tmp_path)
    rewrite_tensors(model_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightsError, match=r"tensor model\.layers\.1\.mlp\.up_proj\.weight is missing"):
        load_tp1(model_dir)


def test_wrong_shape_names_tensor_and_shapes(tmp_path):
    model_dir = copy_fixture("llama_gqa_rope3", tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"  # 2 KV heads * 16 = 32 rows of 64

    def widen(tensors):
        tensors[name] = np.zeros((48, 64), np.float32)

    rewrite_tensors(model_dir, widen)
    with pytest.raises(WeightsError) as e:
        load_tp1(model_dir)
    assert name in str(e.value) and "(48, 64)" in str(e.value) and "(32, 64)" in str(e.value)


def write_config(tmp_path, edit):
    config = json.loads((FIXTURES / "models" / "llama_gqa_rope3" / "config.json").read_text())
    edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_missing_config_json(tmp_path):
    model_dir = copy_fixture("llama_gqa_rope3", tmp_path)
    (model_dir / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_tp1(model_dir)


def test_unsupported_architecture_is_named(tmp_path):
    model_dir = write_config(tmp_path, lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(UnsupportedModelError, match="'GPT2LMHeadModel'"):
        load_tp1(model_dir)


def yarn_5x(config):
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0,
                                 "original_max_position_embeddings": 64}


def yarn_4x(config):
    config.pop("rope_parameters")
    config.update(rope_theta=500000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 64})


@pytest.mark.parametrize("edit", [yarn_5x, yarn_4x], ids=["transformers5", "transformers4"])
def test_unsupported_rope_type_is_named(tmp_path, edit):
    with pytest.raises(UnsupportedModelError, match="'yarn'"):
        load_tp1(write_config(tmp_path, edit))


def test_bfloat16_fixture_is_stored_as_bfloat16():
    """The premise of the bf16 tests: qwen3_qknorm's file really holds bfloat16."""
    tensors = SafetensorsFile(FIXTURES / "models" / "qwen3_qknorm" / "model.safetensors")
    assert {info["dtype"] for info in tensors.tensors.values()} == {"BF16"}
    assert tensors.get("model.norm.weight").dtype == ml_dtypes.bfloat16


def test_header_length_past_the_end_of_the_file_is_named(tmp_path):
    import struct  # noqa: PLC0415


    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(WeightsError, match=f"corrupt safetensors file {path}: header length 1000000 exceeds"):
        SafetensorsFile(path)
