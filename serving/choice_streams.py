"""Async helpers of the HTTP/gRPC front (serving/openai_api.py): the choices of one request
interleaved as their deltas come (`merge`), and a rate-limited client-disconnect check."""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Awaitable, Callable

Disconnected = Callable[[], Awaitable[bool]]


class DisconnectWatch:
    """Polls `is_disconnected` at most every `period_s` seconds."""

    def __init__(self, is_disconnected: Disconnected | None, period_s: float) -> None:
        self.check, self.period_s, self.next = is_disconnected, period_s, 0.0

    async def gone(self) -> bool:
        if self.check is None or time.monotonic() < self.next:
            return False
        self.next = time.monotonic() + self.period_s
        return bool(await self.check())


async def merge(gens: list[AsyncIterator]) -> AsyncIterator:
    """Interleave several choice streams as their deltas come; cancels the rest on exit."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(g):
        try:
            async for d in g:
                await queue.put(d)
        except BaseException as e:  # handed to the consumer, which re-raises it
            await queue.put(e)
        finally:
            await queue.put(done)

    tasks = [asyncio.ensure_future(pump(g)) for g in gens]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
