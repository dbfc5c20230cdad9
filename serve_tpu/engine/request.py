"""Requests as the engine sees them: sampling parameters, per-sequence state, outputs.

`SamplingParams` carries the OpenAI/vLLM set and validates it (errors name the field).
A `Request` with `n > 1` becomes n `Sequence`s that share the prompt (and its cached
pages); each sequence moves WAITING -> RUNNING -> FINISHED, and back to WAITING when
preempted (its pages are freed and its tokens recomputed later).
"""

import dataclasses
import enum
import math

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off (vLLM's -1 is accepted as off too)
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple((int(k), float(v)) for k, v in self.logit_bias.items()))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        for check in _CHECKS:
            check(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


class InvalidParameterError(ValueError):
    """A request parameter is out of range; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def _require(field: str, ok: bool, message: str) -> None:
    if not ok:
        raise InvalidParameterError(field, message)


def _check_lengths(p: SamplingParams) -> None:
    _require("max_tokens", isinstance(p.max_tokens, int) and p.max_tokens >= 1, f"must be >= 1, got {p.max_tokens}")
    _require("min_tokens", 0 <= p.min_tokens <= p.max_tokens,
             f"must be between 0 and max_tokens ({p.max_tokens}), got {p.min_tokens}")
    _require("n", isinstance(p.n, int) and 1 <= p.n <= 128, f"must be between 1 and 128, got {p.n}")


def _check_sampling(p: SamplingParams) -> None:
    _require("temperature", math.isfinite(p.temperature) and 0.0 <= p.temperature <= 2.0,
             f"must be between 0 and 2, got {p.temperature}")
    _require("top_p", 0.0 < p.top_p <= 1.0, f"must be in (0, 1], got {p.top_p}")
    _require("top_k", isinstance(p.top_k, int) and p.top_k >= 0, f"must be -1, 0 or positive, got {p.top_k}")
    _require("min_p", 0.0 <= p.min_p <= 1.0, f"must be in [0, 1], got {p.min_p}")
    _require("seed", p.seed is None or (isinstance(p.seed, int) and 0 <= p.seed < 2**63),
             f"must be a non-negative integer below 2**63, got {p.seed}")


def _check_penalties(p: SamplingParams) -> None:
    _require("presence_penalty", -2.0 <= p.presence_penalty <= 2.0, f"must be in [-2, 2], got {p.presence_penalty}")
    _require("frequency_penalty", -2.0 <= p.frequency_penalty <= 2.0,
             f"must be in [-2, 2], got {p.frequency_penalty}")
    _require("repetition_penalty", 0.0 < p.repetition_penalty <= 2.0,
             f"must be in (0, 2], got {p.repetition_penalty}")
    _require("logit_bias", len(p.logit_bias) <= MAX_LOGIT_BIAS, f"at most {MAX_LOGIT_BIAS} entries")
    for token, bias in p.logit_bias:
        _require("logit_bias", -100.0 <= bias <= 100.0, f"bias for token {token} must be in [-100, 100], got {bias}")


def _check_outputs(p: SamplingParams) -> None:
    _require("top_logprobs", 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS,
             f"must be between 0 and {MAX_TOP_LOGPROBS}, got {p.top_logprobs}")
    _require("top_logprobs", p.top_logprobs == 0 or p.logprobs, "requires logprobs to be true")
    _require("stop", len(p.stop) <= 16 and all(isinstance(s, str) and s for s in p.stop),
             "must be at most 16 non-empty strings")


_CHECKS = (_check_lengths, _check_sampling, _check_penalties, _check_outputs)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    """One output sequence (choice `index` of request `request_id`) and its cache state."""

    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: float
    output_ids: list[int] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached: int = 0  # prompt tokens the prefix cache supplied at admission
    num_preemptions: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def suppressed_ids(self, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
        """Ids that may not be sampled yet: EOS and stop ids before min_tokens."""
        if len(self.output_ids) >= self.params.min_tokens:
            return ()
        return tuple(self.params.stop_token_ids) + (() if self.params.ignore_eos else eos_ids)

    def finish_by_token(self, eos_ids: tuple[int, ...], max_model_len: int) -> FinishReason | None:
        """Reason to finish after the newest token, ignoring stop strings (the detokenizer's job)."""
        last = self.output_ids[-1]
        if last in self.params.stop_token_ids or (not self.params.ignore_eos and last in eos_ids):
            return FinishReason.STOP
        if len(self.output_ids) >= self.params.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None
