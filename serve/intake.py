"""Request bodies off the event loop: a byte budget, bounded parse pools and the chat-template pool.

Nothing a body holds runs on the event loop. A request first takes its body's size from a byte
budget (`ByteBudget`: `BUDGET` bytes of bodies in flight, at most `LARGE_BUDGET` of them in bodies
over `SMALL_BODY`), then its body is read, decoded, checked and tokenised by a small pool of threads:
bodies up to `SMALL_BODY` in one pool, larger ones in another (`Intake.run`), so a small request never
queues behind large ones. Chat templates render in `ChatPool`'s processes, each render under a time
limit; waiting for a free one holds no thread. The work of one request runs as a task of its own
(`Intake.admit`) that keeps the body's bytes until it ends, even when the client has gone, so the
budget counts every body the server still holds. What the event loop itself does per request is
bounded: reading the socket, and handing work to these pools.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

SMALL_BODY = 64 << 10  # bytes: a body up to this size is parsed in the small-body pool
MAX_BODY = 4 << 20  # the largest body (aiohttp's client_max_size: a larger one is a 413)
BUDGET = 24 << 20  # bytes of bodies the server holds at once (read, parsed, tokenised)
LARGE_BUDGET = 16 << 20  # ... of which at most this many in bodies over SMALL_BODY
CHAT_WORKERS = 2  # processes rendering chat templates


class ByteBudget:
    """Bytes of request bodies in flight. `acquire(n)` waits until n more fit; bodies over `small`
    bytes share `large` of the `total`, so small bodies always find room."""

    def __init__(self, total: int = BUDGET, large: int = LARGE_BUDGET, small: int = SMALL_BODY):
        if large > total or large < MAX_BODY:
            raise ValueError("ByteBudget: need MAX_BODY <= large <= total")
        self.total, self.large_total, self.small = total, large, small
        self.used = self.large = 0
        self._changed = asyncio.Condition()

    def _fits(self, n: int) -> bool:
        return self.used + n <= self.total and (n <= self.small or self.large + n <= self.large_total)

    async def acquire(self, n: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self._fits(n))
            self.used += n
            if n > self.small:
                self.large += n

    async def release(self, n: int) -> None:
        async with self._changed:
            self.used -= n
            if n > self.small:
                self.large -= n
            self._changed.notify_all()


class ChatPool:
    """`workers` TemplateWorker processes (data_pipeline/template_worker.py), started on first use. A
    render waits asynchronously for a free one, then runs in a thread of its own (one per process)
    that only waits on the process's pipe; a worker goes back to the pool when its render has ended,
    even when the request that asked for it is gone."""

    def __init__(self, workers: int = CHAT_WORKERS):
        from data_pipeline.template_worker import TemplateWorker

        self.workers = [TemplateWorker() for _ in range(workers)]
        self.threads = ThreadPoolExecutor(workers, thread_name_prefix="setdlm-chat")
        self._idle: asyncio.Queue | None = None

    async def run(self, fn, *args):
        """fn(worker, *args) in a thread with a worker held."""
        if self._idle is None:
            self._idle = asyncio.Queue()
            for w in self.workers:
                self._idle.put_nowait(w)
        worker = await self._idle.get()
        fut = asyncio.get_running_loop().run_in_executor(self.threads, fn, worker, *args)
        fut.add_done_callback(lambda _: self._idle.put_nowait(worker))
        return await asyncio.shield(fut)  # a cancelled caller leaves the render running: the worker stays held

    def close(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)
        for w in self.workers:
            w.close()


class Intake:
    """The pools and the budget of one server."""

    def __init__(self, budget: ByteBudget | None = None, chat_workers: int = CHAT_WORKERS):
        self.budget = budget or ByteBudget()
        self.small = ThreadPoolExecutor(2, thread_name_prefix="setdlm-body")
        self.large = ThreadPoolExecutor(2, thread_name_prefix="setdlm-large-body")
        self.chat = ChatPool(chat_workers)

    async def run(self, size: int, fn, *args):
        """fn(*args) in the pool for a body of `size` bytes."""
        pool = self.small if size <= SMALL_BODY else self.large
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def admit(self, request, work):
        """`await work(raw body)` for `request` within the byte budget: waits for room (the body stays
        unread in the socket meanwhile), then reads and works in a task that holds the room until it
        ends. Cancelling the caller (its client went away) stops the wait, not the task: its threads
        cannot be stopped, so it keeps the room until they are done."""
        n = request.content_length
        if n is not None and n > MAX_BODY:  # refused from its header, before it waits or is read
            raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY, actual_size=n)
        n = MAX_BODY if n is None else max(int(n), 1)  # unknown length (chunked): the most it may be
        await self.budget.acquire(n)

        async def held():
            try:
                return await work(await request.read())
            finally:
                await self.budget.release(n)

        task = asyncio.ensure_future(held())
        task.add_done_callback(_consume)
        return await asyncio.shield(task)

    def close(self) -> None:
        for pool in (self.small, self.large):
            pool.shutdown(wait=False, cancel_futures=True)
        self.chat.close()


def _consume(task: asyncio.Task) -> None:
    """Retrieve the outcome of a task whose caller may be gone (no 'exception was never retrieved')."""
    with contextlib.suppress(asyncio.CancelledError):
        task.exception()
