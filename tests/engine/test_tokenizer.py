"""Tokenizer wrapper and streaming detokenizer on the tiny preset's byte-level BPE tokenizer."""

import json
import random
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_tpu.engine.tokenizer import Delta, Tokenizer

MULTI_BYTE = "héllo wörld 日本語 🙂"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


def stream(detok, ids, chunk_sizes=(1,)) -> list[Delta]:
    """Pushes ids in chunks of the given sizes (cycled); the deltas, ending before any stop."""
    deltas, start, i = [], 0, 0
    while start < len(ids) and not detok.is_finished:
        size = chunk_sizes[i % len(chunk_sizes)]
        deltas.append(detok.push(ids[start:start + size]))
        start, i = start + size, i + 1
    return deltas


def streamed_text(tok, text, stop, chunk_sizes=(1,)) -> tuple[str, str | None]:
    detok = tok.detokenizer(tok.encode("Say:"), stop)
    deltas = stream(detok, tok.encode(text, add_special_tokens=False), chunk_sizes)
    stops = [d.stop for d in deltas if d.stop]
    tail = detok.flush()
    assert detok.text == "".join(d.text for d in deltas) + tail
    return detok.text, (stops[0] if stops else None)


token_ids = st.lists(st.one_of(st.integers(0, 299), st.integers(0, 2047)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ids=token_ids, prompt=token_ids, chunks=st.lists(st.integers(1, 6), min_size=1, max_size=8),
       skip=st.booleans())
def test_deltas_and_flush_join_to_full_decode(tok, ids, prompt, chunks, skip):
    detok = tok.detokenizer(prompt, stop=(), skip_special_tokens=skip)
    deltas = stream(detok, ids, chunks)
    joined = "".join(d.text for d in deltas) + detok.flush()
    assert joined == tok.decode(ids, skip_special_tokens=skip)
    assert all(d.stop is None for d in deltas)


def test_one_token_at_a_time_matches_seeded_random_sequences(tok):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 30))]
        detok = tok.detokenizer([0])
        assert "".join(d.text for d in stream(detok, ids)) + detok.flush() == tok.decode(ids)


def test_multi_byte_characters_never_split(tok):
    ids = tok.encode(MULTI_BYTE, add_special_tokens=False)
    assert len(ids) > len(MULTI_BYTE)  # some characters do span several tokens
    detok = tok.detokenizer(tok.encode("Say:"))
    deltas = stream(detok, ids)
    assert all("\ufffd" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) == MULTI_BYTE
    assert detok.flush() == "" and detok.text == MULTI_BYTE


def test_flush_turns_an_unfinished_character_into_replacement_char(tok):
    ids = tok.encode("a日", add_special_tokens=False)[:-1]  # cut inside the 3-byte character
    detok = tok.detokenizer([0])
    assert [d.text for d in stream(detok, ids)][-1] == ""
    assert detok.flush() == "\ufffd" == tok.decode(ids)[-1]
    assert detok.text == tok.decode(ids)


def test_stop_string_across_tokens_cuts_it_and_everything_after(tok):
    text = "Once upon a time STOP and the rest"
    assert len(tok.encode("STOP", add_special_tokens=False)) > 1
    for chunks in [(1,), (3, 1, 2), (100,)]:
        assert streamed_text(tok, text, ["STOP"], chunks) == ("Once upon a time ", "STOP")


def test_no_push_after_stop(tok):
    detok = tok.detokenizer([0], ["time"])
    delta = detok.push(tok.encode("a time and more", add_special_tokens=False))
    assert delta == Delta("a ", "time")
    with pytest.raises(ValueError, match="finished"):
        detok.push([5])
    assert detok.flush() == "" and detok.text == "a "


def test_stop_prefix_is_held_then_released_on_a_near_miss(tok):
    detok = tok.detokenizer([0], ["STOP"])
    ids = tok.encode("go STOx now", add_special_tokens=False)
    emitted = ""
    for token_id in ids:
        emitted += detok.push([token_id]).text
        assert not emitted.endswith(("S", "ST", "STO"))  # a possible stop start is never sent early
    assert emitted + detok.flush() == "go STOx now"


def test_flush_releases_a_held_stop_prefix(tok):
    detok = tok.detokenizer([0], ["STOP"])
    assert "".join(d.text for d in stream(detok, tok.encode("end ST", add_special_tokens=False))) == "end "
    assert detok.flush() == "ST"


def test_earliest_stop_in_the_text_wins(tok):
    text = "hello world and the robot"
    assert streamed_text(tok, text, ["robot", "world", "the"]) == ("hello ", "world")


def test_stop_choice_does_not_depend_on_push_size(tok):
    # "lo wor" completes before "hello world" does, even though the latter starts earlier
    for chunks in [(1,), (100,)]:
        assert streamed_text(tok, "hello world", ["hello world", "lo wor"], chunks) == ("hel", "lo wor")


def test_stop_at_the_very_start_gives_empty_text(tok):
    assert streamed_text(tok, "Hello there", ["Hel"]) == ("", "Hel")


def test_empty_stop_string_is_rejected(tok):
    with pytest.raises(ValueError, match="''"):
        tok.detokenizer([0], ["ok", ""])


def test_special_tokens_give_no_text_when_skipped(tok):
    ids = [0, 2] + tok.encode("hi", add_special_tokens=False) + [3, 4, 1]
    skipped = tok.detokenizer([0])
    assert "".join(d.text for d in stream(skipped, ids)) + skipped.flush() == "hi"
    kept = tok.detokenizer([0], skip_special_tokens=False)
    assert "".join(d.text for d in stream(kept, ids)) + kept.flush() == tok.decode(ids, skip_special_tokens=False)
    assert "<|eot_id|>" in kept.text


def test_chat_template_ids_match_transformers(tok):
    ids = tok.apply_chat_template(MESSAGES)
    assert ids == list(tok.hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True,
                                                  return_dict=False))
    assert ids.count(0) == 1 and ids[0] == 0  # one BOS, written by the template
    assert len(tok.apply_chat_template(MESSAGES, add_generation_prompt=False)) < len(ids)


def test_encode_decode_and_sizes(tok):
    assert tok.encode("hello")[0] == 0
    assert tok.decode(tok.encode("hello world")) == "hello world"
    assert tok.vocab_size == 2048
    assert {1, 4} <= set(tok.eos_token_ids) and isinstance(tok.eos_token_ids, tuple)
    with pytest.raises(TypeError, match="text must be a str"):
        tok.encode([1, 2])


def test_missing_tokenizer_names_the_directory(tiny_model_dir, tmp_path):
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        Tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer(tmp_path / "nowhere")


def test_chat_without_template_names_the_directory(tiny_model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(tmp_path)
    assert tok.encode("hi")  # plain prompts still work
    with pytest.raises(ValueError, match=f"{tmp_path}.*no chat_template"):
        tok.apply_chat_template(MESSAGES)
