"""Async plumbing shared by the routes: SSE framing, merging per-prompt streams, disconnect watching.

Cancellation is how requests get aborted: cancelling a task that is inside TokenizerManager.generate runs the
generator's `finally`, which aborts the request in the engine. So every helper here, when it stops early,
cancels what it started and waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

SSE_DONE = "data: [DONE]\n\n"

logger = logging.getLogger(__name__)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_response(events: AsyncIterator[str], path: str) -> StreamingResponse:
    # X-Accel-Buffering: no keeps reverse proxies (nginx) from batching the events.
    return StreamingResponse(_noting_departure(events, path), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _noting_departure(events: AsyncIterator[str], path: str) -> AsyncIterator[str]:
    """The events; a stream its client leaves early (the response task is cancelled) is logged once, at info
    level: an abort, not an error. Closing `events` aborts its requests."""
    done = False
    try:
        async with contextlib.aclosing(events) as it:
            async for event in it:
                yield event
        done = True
    finally:
        if not done:
            logger.info("%s: the client went away mid-stream; its requests were aborted", path)


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


async def _wait_disconnect(request: Request) -> None:
    # After the body has been read, receive() only returns when the client disconnects (or the response is done).
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable) -> Any:
    """Await `work`; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def run_all(works: list[Awaitable]) -> list[Any]:
    """Like gather, but the first failure cancels the rest (so their requests are aborted, not left running)."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


_END = object()


async def merge_streams(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators as (index, item) in arrival order; an exception in any is re-raised
    after the others are cancelled."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as it:
            async for item in it:
                yield 0, item
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator) -> None:
        async with contextlib.aclosing(stream) as it:
            try:
                async for item in it:
                    q.put_nowait((i, item, None))
            except Exception as e:  # handed to the consumer, which re-raises it
                q.put_nowait((i, None, e))
                return
        q.put_nowait((i, _END, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, err = await q.get()
            if err is not None:
                raise err
            if item is _END:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
