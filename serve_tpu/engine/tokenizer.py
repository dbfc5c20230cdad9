"""Text <-> token ids for one model directory, and streaming detokenization with stop strings.

`Tokenizer` wraps the transformers fast tokenizer of a model directory: prompts and chat
messages go in as text, token ids come out. Generated ids come back through one
`IncrementalDetokenizer` per output sequence: `push(ids)` decodes them with the `tokenizers`
library's `DecodeStream` (which holds back bytes of an unfinished UTF-8 character), then
checks stop strings on the decoded text and returns a `Delta` of the text that is safe to
send. `flush()` ends the sequence and releases what was held back; bytes of a character that
never completed come out as U+FFFD, exactly as `Tokenizer.decode` shows them.
"""

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers.decoders import DecodeStream

REPLACEMENT_CHAR = "\ufffd"
MAX_CONTEXT_IDS = 4  # prompt ids that prime the stream (leading-space rules of some decoders)


@dataclasses.dataclass(frozen=True, slots=True)
class Delta:
    """New text safe to send now; `stop` is the stop string that ended the sequence, if any."""

    text: str
    stop: str | None = None


class Tokenizer:
    """The fast tokenizer of a model directory, with the model's end-of-sequence ids."""

    def __init__(self, model_dir):
        self.model_dir = Path(model_dir)
        self.hf = _load_hf_tokenizer(self.model_dir)
        self.eos_token_ids = _eos_token_ids(self.model_dir, self.hf.eos_token_id)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added (special) tokens included."""
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}: {text!r:.80}")
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids of a chat; the template writes BOS itself, so none is added on top."""
        if self.hf.chat_template is None:
            raise ValueError(f"the tokenizer in {self.model_dir} has no chat_template; send a completion prompt")
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"messages must be a non-empty list, got {messages!r:.80}")
        return list(self.hf.apply_chat_template(messages, tokenize=True, return_dict=False,
                                                add_generation_prompt=add_generation_prompt))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, prompt_ids: Sequence[int], stop: Sequence[str] = (),
                    skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self.hf.backend_tokenizer, prompt_ids, stop, skip_special_tokens)


def _load_hf_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    try:
        hf = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"no loadable tokenizer files (tokenizer.json, tokenizer_config.json) "
                                f"in {model_dir}: {e}") from e
    if not hf.is_fast:
        raise ValueError(f"the tokenizer in {model_dir} is not a fast tokenizer; add a tokenizer.json")
    return hf


def _eos_token_ids(model_dir: Path, tokenizer_eos: int | None) -> tuple[int, ...]:
    """Union of eos ids from generation_config.json, config.json and the tokenizer, sorted."""
    ids = set() if tokenizer_eos is None else {tokenizer_eos}
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update([value] if isinstance(value, int) else value or [])
    return tuple(sorted(ids))


class IncrementalDetokenizer:
    """Turns the ids of one output sequence into text deltas, cut at the first stop string.

    Text that could still grow into a stop string is held back until it is resolved. Among
    several stop strings the match that completes first in the text wins (ties: the one that
    starts first), so the result does not depend on how ids are grouped into pushes.
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True):
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        context = _stream_context(tokenizer, list(prompt_ids), skip_special_tokens)
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._ids = list(context)  # context + every pushed id
        self._num_undecoded = 0  # trailing ids of _ids the stream has not turned into text yet
        self._held = ""  # decoded text that may be the start of a stop string
        self._pieces: list[str] = []
        self.is_finished = False

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._pieces)

    def push(self, token_ids: Sequence[int]) -> Delta:
        if self.is_finished:
            raise ValueError(f"detokenizer is finished (stop or flush); cannot push {list(token_ids)}")
        decoded = "".join(self._step(token_id) for token_id in token_ids)
        return self._release(self._held + decoded, is_final=False)

    def flush(self) -> str:
        """End of generation: releases held-back text; an unfinished character becomes U+FFFD."""
        if self.is_finished:
            return ""
        return self._release(self._held + self._undecoded_text(), is_final=True).text

    def _step(self, token_id: int) -> str:
        self._ids.append(token_id)
        piece = self._stream.step(self._tokenizer, token_id)
        self._num_undecoded = 0 if piece is not None else self._num_undecoded + 1
        return piece or ""

    def _undecoded_text(self) -> str:
        """Lossy decode of the ids the stream still holds, in the context of the ids before them."""
        if not self._num_undecoded:
            return ""
        start = len(self._ids) - self._num_undecoded
        context = self._ids[max(0, start - MAX_CONTEXT_IDS):start]
        before = self._tokenizer.decode(context, skip_special_tokens=self._skip_special_tokens)
        whole = self._tokenizer.decode(context + self._ids[start:], skip_special_tokens=self._skip_special_tokens)
        if whole.startswith(before):
            return whole[len(before):]
        return self._tokenizer.decode(self._ids[start:], skip_special_tokens=self._skip_special_tokens)

    def _release(self, pending: str, is_final: bool) -> Delta:
        """Emits `pending` up to a stop string (then finishes) or up to a possible stop prefix."""
        match = _first_stop(pending, self._stop)
        if match is not None:
            index, stop = match
            self.is_finished = True
            return self._emit(pending[:index], held="", stop=stop)
        self.is_finished = is_final
        num_held = 0 if is_final else _stop_prefix_length(pending, self._stop)
        return self._emit(pending[:len(pending) - num_held], held=pending[len(pending) - num_held:])

    def _emit(self, text: str, held: str, stop: str | None = None) -> Delta:
        self._held = held
        if text:
            self._pieces.append(text)
        return Delta(text, stop)


def _stream_context(tokenizer, prompt_ids: list[int], skip_special_tokens: bool) -> list[int]:
    """The last prompt ids, unless they end inside a character (the stream would re-emit them)."""
    context = prompt_ids[-MAX_CONTEXT_IDS:]
    text = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
    return [] if text.endswith(REPLACEMENT_CHAR) else context


def _first_stop(text: str, stop: tuple[str, ...]) -> tuple[int, str] | None:
    """(start, stop string) of the match that ends first in `text` (ties: starts first), or None."""
    best = None
    for s in stop:
        index = text.find(s)
        if index >= 0 and (best is None or (index + len(s), index) < (best[0] + len(best[1]), best[0])):
            best = (index, s)
    return best


def _stop_prefix_length(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the beginning of some stop string."""
    for length in range(min(len(text), max(map(len, stop), default=1) - 1), 0, -1):
        if any(s.startswith(text[-length:]) for s in stop):
            return length
    return 0
