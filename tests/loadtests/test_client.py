"""One streamed request against canned server-sent events (httpx.MockTransport, no sockets)."""

import asyncio
import json
import time

import httpx
import pytest

from loadtests.client import RequestRecord, Target, request_body, send_request


def sse(*events) -> bytes:
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    return "".join(lines).encode()


def chat_chunk(content=None, role=None) -> dict:
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return {"choices": [{"index": 0, "delta": delta}], "usage": None}


def send(handler, endpoint="chat", is_usage=True) -> tuple[RequestRecord, list]:
    """Run send_request against `handler`; returns the record and the bodies the server got."""
    bodies = []

    def recording(request: httpx.Request):
        assert request.headers["authorization"] == "Bearer k"
        bodies.append(json.loads(request.content))
        return handler(request)

    target = Target("http://server/v1", "m", endpoint, api_key="k", is_usage=is_usage)
    record = RequestRecord(0, False, 5, 8, scheduled_s=0.0)
    start = time.perf_counter()

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(recording)) as http:
            await send_request(http, target, "hello there", record,
                               lambda: time.perf_counter() - start, lambda text: len(text.split()))

    asyncio.run(go())
    return record, bodies


def test_chat_first_token_skips_the_role_chunk_and_usage_wins():
    body = sse(chat_chunk(role="assistant", content=""), chat_chunk("Hi"), chat_chunk(" there"),
               {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3}}, "[DONE]")
    record, bodies = send(lambda r: httpx.Response(200, content=body))
    assert record.is_ok and record.status == 200
    assert len(record.chunk_s) == 2 and record.first_token_s == record.chunk_s[0]
    assert (record.num_output_tokens, record.output_tokens_source) == (3, "usage")
    assert record.num_server_prompt_tokens == 12
    assert record.sent_s <= record.first_token_s <= record.end_s
    assert bodies[0]["messages"] == [{"role": "user", "content": "hello there"}]


def test_completions_without_usage_count_with_the_tokenizer():
    body = sse({"choices": [{"text": "one two"}]}, {"choices": [{"text": " three"}]}, "[DONE]")
    record, bodies = send(lambda r: httpx.Response(200, content=body), "completions", is_usage=False)
    assert (record.num_output_tokens, record.output_tokens_source) == (3, "tokenizer")
    assert "stream_options" not in bodies[0] and bodies[0]["prompt"] == "hello there"


def test_a_stream_without_done_ends_with_its_body():
    record, _ = send(lambda r: httpx.Response(200, content=sse(chat_chunk("a"), chat_chunk(" b"))))
    assert record.is_ok and record.end_s >= record.chunk_s[-1]
    assert (record.num_output_tokens, record.output_tokens_source) == (2, "tokenizer")


def test_http_errors_are_recorded_by_status():
    record, _ = send(lambda r: httpx.Response(429, json={"error": "slow down"}))
    assert (record.status, record.error_kind) == (429, "429") and "slow down" in record.error
    assert record.end_s is not None and not record.is_ok


@pytest.mark.parametrize("body, kind", [
    (sse(chat_chunk("a"), {"error": {"message": "engine died"}}), "stream"),
    (sse(chat_chunk("a"), "{broken"), "stream"),
    (sse(chat_chunk("a"), "[1, 2]"), "stream"),
    (sse(chat_chunk(role="assistant", content=""), "[DONE]"), "empty"),
])
def test_bad_streams_are_recorded(body, kind):
    record, _ = send(lambda r: httpx.Response(200, content=body))
    assert record.error_kind == kind and record.status == 200


@pytest.mark.parametrize("error, kind", [(httpx.ConnectError("refused"), "connection"),
                                         (httpx.ReadTimeout("slow"), "timeout")])
def test_network_failures_are_recorded(error, kind):
    def fail(request):
        raise error

    record, _ = send(fail)
    assert record.error_kind == kind and record.status is None and record.end_s is not None


def test_chunk_times_follow_the_stream():
    async def paced():
        yield sse(chat_chunk(role="assistant", content=""))
        for word in ("a", "b", "c"):
            await asyncio.sleep(0.03)
            yield sse(chat_chunk(word))
        yield sse("[DONE]")

    record, _ = send(lambda r: httpx.Response(200, content=paced()))
    gaps = [b - a for a, b in zip(record.chunk_s, record.chunk_s[1:])]
    assert record.first_token_s - record.sent_s >= 0.03
    assert all(0.02 < g < 0.1 for g in gaps)


def test_request_body_and_target():
    target = Target("http://h:1/v1/", "m", "completions", extra_body={"temperature": 0.7, "top_k": 3})
    body = request_body(target, "p", 4)
    assert body["ignore_eos"] is True and body["stream"] is True and body["max_tokens"] == 4
    assert body["stream_options"] == {"include_usage": True}
    assert (body["temperature"], body["top_k"]) == (0.7, 3)  # extra body wins
    assert target.url == "http://h:1/v1/completions" and target.root == "http://h:1"
    assert "ignore_eos" not in request_body(Target("http://h", "m", is_ignore_eos=False), "p", 1)
    with pytest.raises(ValueError, match="'embeddings'"):
        Target("http://h", "m", "embeddings")
    with pytest.raises(ValueError, match="'h:1'"):
        Target("h:1", "m")
