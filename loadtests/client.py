"""Client: one streamed OpenAI-compatible request in, one `RequestRecord` of timings out.

`Target` names the server (base URL, `completions` or `chat` endpoint, model) and the fixed
request fields. `send_request` posts `stream: true` (with `stream_options.include_usage`),
reads the server-sent events (`data: {...}` lines up to `data: [DONE]`) and stamps, on the
runner's clock (seconds from the run's start): when the request was sent, every chunk that
carries content (so the first one is the first token, not chat's role-only chunk), and the end
(`[DONE]`, or the end of the body for servers that send none).
The output token count is the server's `usage.completion_tokens` when it sends usage, else the
tokenizer's count of the streamed text. Failures are recorded, never raised: `error_kind` is
the HTTP status ("429") or one of "timeout", "connection", "stream", "empty".
"""

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
ERROR_TEXT_CHARS = 200


@dataclass(frozen=True)
class Target:
    base_url: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    is_ignore_eos: bool = True
    is_usage: bool = True  # ask for stream_options.include_usage
    extra_body: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base URL must start with http:// or https://, got {self.base_url!r}")

    @property
    def root(self) -> str:
        """The server root: base URL without a trailing "/" or "/v1"."""
        root = self.base_url.rstrip("/")
        return root[:-3] if root.endswith("/v1") else root

    @property
    def url(self) -> str:
        return self.root + ENDPOINTS[self.endpoint]

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestRecord:
    index: int
    is_warmup: bool
    num_prompt_tokens: int  # the workload's count of the prompt text
    max_tokens: int
    scheduled_s: float
    sent_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)  # arrival of every content chunk
    num_output_tokens: int = 0
    output_tokens_source: str = ""  # "usage" or "tokenizer"
    num_server_prompt_tokens: int | None = None  # usage.prompt_tokens (includes any template)
    status: int | None = None
    error_kind: str = ""  # "" when the request succeeded
    error: str = ""

    @property
    def is_ok(self) -> bool:
        return not self.error_kind


def request_body(target: Target, text: str, max_tokens: int) -> dict:
    body = {"model": target.model, "max_tokens": max_tokens, "stream": True, "temperature": 0.0}
    if target.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if target.is_usage:
        body["stream_options"] = {"include_usage": True}
    if target.is_ignore_eos:
        body["ignore_eos"] = True
    return body | target.extra_body


async def send_request(http: httpx.AsyncClient, target: Target, text: str, record: RequestRecord,
                       clock: Callable[[], float], count_tokens: Callable[[str], int]) -> None:
    """Stream one request and fill `record` in place; never raises for server or network faults."""
    body = request_body(target, text, record.max_tokens)
    pieces: list[str] = []
    record.sent_s = clock()
    try:
        async with http.stream("POST", target.url, json=body, headers=target.headers) as response:
            record.status = response.status_code
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")
                _fail(record, str(response.status_code), detail)
            else:
                await _read_stream(response, target, record, pieces, clock)
    except httpx.TimeoutException as e:
        _fail(record, "timeout", repr(e))
    except httpx.TransportError as e:
        _fail(record, "connection", repr(e))
    except httpx.HTTPError as e:
        _fail(record, "stream", repr(e))
    record.end_s = clock() if record.end_s is None else record.end_s
    _finish(record, "".join(pieces), count_tokens)


async def _read_stream(response: httpx.Response, target: Target, record: RequestRecord,
                       pieces: list[str], clock: Callable[[], float]) -> None:
    """Apply each event; stamp the end at `[DONE]`, then drain the body so the connection
    goes back to the pool (closing it mid-body would cost every request a new connection)."""
    async for line in response.aiter_lines():
        if record.end_s is not None or not line.startswith("data:"):
            continue  # after [DONE]; blank separators, ": comments", "event:" lines
        data = line[5:].strip()
        if data == "[DONE]":
            record.end_s = clock()
            continue
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            event = None
        if not isinstance(event, dict):
            return _fail(record, "stream", f"not a JSON object: {data[:ERROR_TEXT_CHARS]}")
        if "error" in event or event.get("object") == "error":
            return _fail(record, "stream", json.dumps(event.get("error", event)))
        _apply_event(event, target, record, pieces, clock())


def _apply_event(event: dict, target: Target, record: RequestRecord, pieces: list[str],
                 now: float) -> None:
    usage = event.get("usage") or {}
    if usage.get("completion_tokens") is not None:
        record.num_output_tokens = int(usage["completion_tokens"])
        record.output_tokens_source = "usage"
    if usage.get("prompt_tokens") is not None:
        record.num_server_prompt_tokens = int(usage["prompt_tokens"])
    text = "".join(_content(choice, target.endpoint) for choice in event.get("choices") or [])
    if text:
        record.first_token_s = now if record.first_token_s is None else record.first_token_s
        record.chunk_s.append(now)
        pieces.append(text)


def _content(choice: dict, endpoint: str) -> str:
    """Generated text of one streamed choice; chat reasoning text counts as content."""
    if endpoint == "completions":
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


def _finish(record: RequestRecord, text: str, count_tokens: Callable[[str], int]) -> None:
    if record.is_ok and record.first_token_s is None:
        _fail(record, "empty", "the stream ended without any content")
    if record.is_ok and record.output_tokens_source != "usage":
        record.num_output_tokens = count_tokens(text)
        record.output_tokens_source = "tokenizer"


def _fail(record: RequestRecord, kind: str, detail: str) -> None:
    record.error_kind = kind
    record.error = detail[:ERROR_TEXT_CHARS]
