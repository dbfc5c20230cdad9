"""AsyncEngine: streaming, abort and disconnect free pages, a dead loop fails requests and health."""

import asyncio

import pytest

from serve_tpu.engine.async_engine import AsyncEngine
from serve_tpu.engine.engine import EngineDeadError
from serve_tpu.engine.request import FinishReason, SamplingParams

PARAMS = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


async def until_idle(llm_engine, timeout_s: float = 10.0) -> None:
    """An abort during a step takes effect when that step ends; wait for it (bounded)."""
    for _ in range(int(timeout_s / 0.01)):
        if not llm_engine.requests and not llm_engine.has_work():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine still busy after {timeout_s}s: {list(llm_engine.requests)}")


def test_stream_then_consumer_stops_early_frees_pages(idle_engine):
    async def main():
        engine = AsyncEngine(idle_engine)
        full = [o async for o in engine.generate("whole", list(range(5, 25)), PARAMS)]
        assert sum(len(o.outputs[0].token_ids) for o in full) == 30
        assert full[-1].is_finished and full[-1].outputs[0].finish_reason == FinishReason.LENGTH
        stream = engine.generate("early", list(range(5, 25)), PARAMS)
        async for _ in stream:
            break  # like a client that disconnects after the first chunk
        await stream.aclose()
        await until_idle(idle_engine)
        assert idle_engine.allocator.usage() == 0
        await engine.shutdown()
    asyncio.run(main())


def test_abort_while_streaming_ends_the_stream_and_frees_pages(idle_engine):
    async def main():
        engine = AsyncEngine(idle_engine)

        async def consume():
            return [o async for o in engine.generate("victim", list(range(30)), PARAMS)]

        task = asyncio.create_task(consume())
        while not idle_engine.requests.get("victim") or not idle_engine.requests["victim"].seqs[0].output_ids:
            await asyncio.sleep(0.01)
        engine.abort("victim")
        with pytest.raises(asyncio.CancelledError):
            await task
        await until_idle(idle_engine)
        assert idle_engine.allocator.usage() == 0
        await engine.shutdown()
    asyncio.run(main())


def test_invalid_request_raises_before_streaming(idle_engine):
    async def main():
        engine = AsyncEngine(idle_engine)
        with pytest.raises(ValueError, match="exceeds the context window"):
            async for _ in engine.generate("big", [1] * 150, SamplingParams(max_tokens=50)):
                pass
    asyncio.run(main())


def test_a_failing_step_fails_open_requests_and_health(idle_engine, monkeypatch):
    async def main():
        engine = AsyncEngine(idle_engine)
        monkeypatch.setattr(idle_engine.runner, "run", lambda plan: (_ for _ in ()).throw(RuntimeError("device lost")))
        with pytest.raises(EngineDeadError, match="device lost"):
            async for _ in engine.generate("doomed", list(range(10)), PARAMS):
                pass
        with pytest.raises(EngineDeadError):
            engine.check_health()
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("after", list(range(10)), PARAMS):
                pass
    asyncio.run(main())
