"""A fake OpenAI-compatible server that streams at a known pace, for load-tool tests.

`FakeServer(Pace(...))` is a context manager: it serves a FastAPI app with uvicorn on
127.0.0.1 (a free port) in a background thread and stops it on exit. Both endpoints stream
`max_tokens` one-token chunks: the first `ttft_s` after the request arrives, then one every
`itl_s` (paced from the request's arrival, so sleeps do not drift); chat sends its role-only
chunk at once, before the first token. Every `reject_every`-th request (1-based) gets 429.
`/metrics` speaks vLLM's metric names through a prometheus_client registry of its own;
`/connections` says how many TCP connections the completion requests came on.
"""

import asyncio
import json
import threading
import time
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

CHUNK_TEXT = " tok"


@dataclass(frozen=True)
class Pace:
    ttft_s: float = 0.05
    itl_s: float = 0.01
    reject_every: int = 0  # 0: never reject
    is_metrics: bool = True


class _Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "running", registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "waiting", registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "kv cache usage", registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "generation tokens", registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "prefix queries", registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "prefix hits", registry=r)


def build_app(pace: Pace) -> FastAPI:
    app = FastAPI()
    metrics = _Metrics()
    num_arrived = [0]  # per app, not global
    client_ports: set[int] = set()  # one per TCP connection the client opened

    async def handle(request: Request, is_chat: bool):
        arrived = time.perf_counter()
        body = await request.json()
        num_arrived[0] += 1
        client_ports.add(request.client.port)
        if pace.reject_every and num_arrived[0] % pace.reject_every == 0:
            return JSONResponse({"error": {"message": "too many requests"}}, status_code=429)
        return _stream(pace, metrics, arrived, body, is_chat)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, is_chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, is_chat=True)

    @app.get("/connections")
    async def connections():
        return {"num_connections": len(client_ports)}

    @app.get("/metrics")
    async def prometheus():
        if not pace.is_metrics:
            return PlainTextResponse("not found", status_code=404)
        return PlainTextResponse(generate_latest(metrics.registry).decode())

    return app


def _stream(pace: Pace, metrics: _Metrics, arrived: float, body: dict,
            is_chat: bool) -> StreamingResponse:
    num_prompt = len((body["messages"][-1]["content"] if is_chat else body["prompt"]).split())
    metrics.prompt_tokens.inc(num_prompt)
    metrics.prefix_queries.inc(num_prompt)
    metrics.prefix_hits.inc(num_prompt // 2)
    is_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return StreamingResponse(_events(pace, metrics, arrived, is_chat, int(body["max_tokens"]),
                                     num_prompt, is_usage), media_type="text/event-stream")


async def _events(pace: Pace, metrics: _Metrics, arrived: float, is_chat: bool,
                  num_tokens: int, num_prompt: int, is_usage: bool):
    metrics.running.inc()
    metrics.kv_usage.set(0.5)
    try:
        if is_chat:
            yield _sse(_choice({"role": "assistant", "content": ""}, is_chat))
        for i in range(num_tokens):
            delay = arrived + pace.ttft_s + i * pace.itl_s - time.perf_counter()
            await asyncio.sleep(max(delay, 0.0))
            metrics.generation_tokens.inc()
            yield _sse(_choice({"content": CHUNK_TEXT} if is_chat else CHUNK_TEXT, is_chat))
        if is_usage:
            usage = {"prompt_tokens": num_prompt, "completion_tokens": num_tokens,
                     "total_tokens": num_prompt + num_tokens}
            yield _sse({"choices": [], "usage": usage})
        yield "data: [DONE]\n\n"
    finally:
        metrics.running.dec()
        metrics.kv_usage.set(0.0)


def _choice(content, is_chat: bool) -> dict:
    choice = {"index": 0, "delta": content} if is_chat else {"index": 0, "text": content}
    return {"object": "chat.completion.chunk" if is_chat else "text_completion",
            "choices": [choice | {"finish_reason": None}], "usage": None}


def _sse(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"


class FakeServer:
    """Context manager: `with FakeServer(Pace()) as server: server.url`."""

    def __init__(self, pace: Pace):
        config = uvicorn.Config(build_app(pace), host="127.0.0.1", port=0, log_level="warning",
                                lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self.url = ""

    def __enter__(self) -> "FakeServer":
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the fake server did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
