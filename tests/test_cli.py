"""The `serve-tpu` command line: make-model and generate end to end, and its error exits."""

from transformers import AutoTokenizer

from serve_tpu.cli import main
from serve_tpu.config import MeshConfig
from serve_tpu.model.generate import LoadedModel, generate


def test_make_model_then_generate_prints_the_completion(tmp_path, capsys):
    model_dir = tmp_path / "tiny"
    assert main(["make-model", "tiny", str(model_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(model_dir)
    prompt = "Hello! How are you today?"
    assert main(["generate", str(model_dir), "--prompt", prompt, "--max-tokens", "6",
                 "--ignore-eos", "--tp", "2", "--stats"]) == 0
    captured = capsys.readouterr()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    expected = generate(LoadedModel.load(model_dir, MeshConfig(tp=1)), tokenizer.encode(prompt), 6)
    assert len(expected) == 6
    assert captured.out == tokenizer.decode(expected, skip_special_tokens=True) + "\n"
    assert "decode 4 steps: median" in captured.err


def test_generate_rejects_bad_arguments(tiny_model_dir, capsys):
    assert main(["generate", str(tiny_model_dir), "--prompt", "x", "--max-tokens", "0"]) == 2
    assert "--max-tokens must be >= 1, got 0" in capsys.readouterr().err
    assert main(["generate", str(tiny_model_dir), "--prompt", "x", "--max-tokens", "5000"]) == 2
    assert "exceeds the model's context of 2048 tokens" in capsys.readouterr().err


def test_missing_model_dir_is_a_clear_error(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert f"no config.json in model directory {tmp_path / 'nope'}" in capsys.readouterr().err
