"""router/streams.py: closing a merged stream closes every source at once."""

from __future__ import annotations

import asyncio

import pytest


@pytest.mark.parametrize("count", [1, 3])
def test_closing_a_merged_stream_closes_every_source_at_once(count):
    """An abandoned worker stream must cancel its call when the response ends, not at garbage collection."""
    from raylm.router.streams import merge_indexed

    closed: list[int] = []

    async def source(index: int):
        try:
            for i in range(100):
                yield i
                await asyncio.sleep(0)
        finally:
            closed.append(index)

    async def main() -> None:
        sources = [source(i) for i in range(count)]
        merged = merge_indexed(sources)
        await anext(merged)
        await merged.aclose()
        assert sorted(closed) == list(range(count))

    asyncio.run(main())
