"""A function mapped over a stream on a few threads, its results handed on in the stream's order.

vLLM's reader uses it: each connector file is read, checked, mapped and hashed by one of several threads (the work
is torch kernels, file reads and sha256, which release the GIL), while the shards still receive the samples in the
order the engine reported them, so the shards a run writes do not depend on how many readers it had.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def ordered_map(fn: Callable[[T], R], items: Iterable[T], workers: int, ahead: int | None = None,
                on_drop: Callable[[T], None] | None = None, name: str = "eagle3-reader") -> Iterator[R]:
    """fn(item) for each item, in the items' order. With `workers` > 1 they run on that many threads, at most
    `ahead` (default 2 x workers) submitted and not yet handed on: that bounds the memory the results hold. Done
    results are handed on whenever the next item arrives, and all of them once `items` ends. An exception in fn is
    raised here at its item's turn (the results before it are handed on first); the items not yet started are
    then dropped, each passed to `on_drop` (what fn would have cleaned up: vLLM's files), as they are when the
    consumer stops early."""
    if workers <= 1:
        for item in items:
            yield fn(item)
        return
    limit = max(1, ahead or 2 * workers)
    window: deque[tuple[T, Future[R]]] = deque()
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
    try:
        for item in items:
            window.append((item, pool.submit(fn, item)))
            while window and (window[0][1].done() or len(window) >= limit):
                yield window.popleft()[1].result()
        while window:
            yield window.popleft()[1].result()
    finally:
        dropped = [item for item, future in window if future.cancel()]
        pool.shutdown(wait=True)
        if on_drop is not None:
            for item in dropped:
                on_drop(item)
