"""Merge several async streams into one, as the completions API does for a list of prompts."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncGenerator, AsyncIterator, Sequence, TypeVar

T = TypeVar("T")

_DONE = object()


async def merge_indexed(streams: Sequence[AsyncGenerator[T, None]]) -> AsyncIterator[tuple[int, T]]:
    """Yield ``(stream index, item)`` as items arrive; the first error cancels the others. Every
    stream is closed on the way out, so an abandoned worker stream cancels its call at once
    (freeing KV blocks and routing charges), not whenever it is garbage collected."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as stream:
            async for item in stream:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    await queue.put((index, item))
        except BaseException as err:  # handed to the consumer, which re-raises it
            await queue.put((index, err))
            return
        await queue.put((index, _DONE))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
