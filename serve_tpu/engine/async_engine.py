"""AsyncEngine: the asyncio face of `LLMEngine` that servers use.

One background task runs `LLMEngine.step()` in a worker thread while there is work and
sleeps otherwise. Requests are added and aborted only on the event loop between steps, so
the engine is never touched by two threads. `generate()` yields `RequestOutput`s from a
per-request queue; a consumer that stops early (client disconnect = CancelledError) aborts
the request, which frees its pages before the next step. If a step raises, the loop stops,
every open request receives `EngineDeadError`, and `check_health()` raises from then on.
"""

import asyncio
import logging
from collections.abc import AsyncIterator

from serve_tpu.engine.engine import EngineDeadError, LLMEngine, RequestOutput
from serve_tpu.engine.request import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._error: BaseException | None = None
        self._is_stepping = False
        self._pending: list = []  # engine calls that arrived during a step, applied after it

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request; invalid input raises before anything is yielded."""
        self.check_health()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already running")
        self.engine.validate(request_id, prompt_ids, params)
        queue = self._queues[request_id] = asyncio.Queue()
        self._call(self.engine.add_request, request_id, prompt_ids, params)
        self._ensure_loop()
        is_finished = False
        try:
            while not is_finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                is_finished = item.is_finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not is_finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Frees the request's pages now, or right after the step in flight."""
        self._call(self.engine.abort, request_id)
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(asyncio.CancelledError(f"request {request_id} was aborted"))

    def check_health(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine loop failed: {self._error!r}") from self._error

    def _call(self, fn, *args) -> None:
        """Run an engine mutation now, or after the step in flight (never concurrently)."""
        if self._is_stepping:
            self._pending.append((fn, args))
        else:
            fn(*args)

    def _ensure_loop(self) -> None:
        self._wake.set()
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())

    async def _run_loop(self) -> None:
        try:
            while True:
                if not self.engine.has_work():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self._is_stepping = True
                try:
                    outputs = await asyncio.to_thread(self.engine.step)
                finally:
                    self._is_stepping = False
                    for fn, args in self._pending:
                        fn(*args)
                    self._pending.clear()
                for output in outputs:
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
        except Exception as e:  # the engine is broken: fail every open request, report unhealthy
            logger.exception("engine loop failed")
            self._error = e
            for request_id, queue in list(self._queues.items()):
                queue.put_nowait(EngineDeadError(f"engine loop failed: {e!r}"))

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
