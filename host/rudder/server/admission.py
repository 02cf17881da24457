"""Back-pressure: at most `max_concurrent` requests in the engine, at most `max_queue` more
waiting for a place; past that a request is refused at once with 429."""

from __future__ import annotations

import asyncio

from .errors import APIError


class Admission:
    def __init__(self, max_concurrent: int, max_queue: int):
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.active = 0
        self.waiting = 0
        self._free: asyncio.Semaphore | None = None  # made on the server's event loop

    async def acquire(self) -> None:
        if self._free is None:
            self._free = asyncio.Semaphore(self.max_concurrent)
        if self._free.locked() and self.waiting >= self.max_queue:
            raise APIError("too_many_requests", f"the server is busy ({self.active} running, "
                           f"{self.waiting} queued); retry later")
        self.waiting += 1
        try:
            await self._free.acquire()
        finally:
            self.waiting -= 1
        self.active += 1

    def release(self) -> None:
        self.active -= 1
        self._free.release()
