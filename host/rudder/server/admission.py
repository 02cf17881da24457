"""Back-pressure: at most `max_concurrent` requests in the engine, at most `max_queue` more
waiting for a place; past that a request is refused at once with 429 (and Retry-After). With
`tenant_max_concurrent`, one tenant's requests (running and waiting together) are capped too, so
one tenant cannot fill the queue: its next request gets the 429, nobody else's does."""

from __future__ import annotations

import asyncio
import collections

from .errors import APIError


class Admission:
    def __init__(self, max_concurrent: int, max_queue: int, tenant_max_concurrent: int | None = None):
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.tenant_max_concurrent = tenant_max_concurrent
        self.active = 0
        self.waiting = 0
        self.by_tenant: collections.Counter = collections.Counter()  # running + waiting
        self._free: asyncio.Semaphore | None = None  # made on the server's event loop

    async def acquire(self, tenant: str = "anonymous") -> None:
        if self._free is None:
            self._free = asyncio.Semaphore(self.max_concurrent)
        cap = self.tenant_max_concurrent
        if cap is not None and self.by_tenant[tenant] >= cap:
            raise APIError("too_many_requests", f"tenant {tenant!r} already has {self.by_tenant[tenant]} requests "
                           f"(its limit is {cap}); retry later", code="tenant_concurrency")
        if self._free.locked() and self.waiting >= self.max_queue:
            raise APIError("too_many_requests", f"the server is busy ({self.active} running, "
                           f"{self.waiting} queued); retry later", code="server_busy")
        self.by_tenant[tenant] += 1
        self.waiting += 1
        try:
            await self._free.acquire()
        except BaseException:
            self._drop(tenant)
            raise
        finally:
            self.waiting -= 1
        self.active += 1

    def release(self, tenant: str = "anonymous") -> None:
        self.active -= 1
        self._drop(tenant)
        self._free.release()

    def _drop(self, tenant: str) -> None:
        self.by_tenant[tenant] -= 1
        if self.by_tenant[tenant] <= 0:
            del self.by_tenant[tenant]
