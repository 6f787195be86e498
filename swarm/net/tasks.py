"""Tasks that end accounted for: run steps together, cancel the rest, take every failure.

A task that ends with an exception nobody retrieves is logged by asyncio ("Task exception was never retrieved")
when the garbage collector finds it: at any later moment, in whatever code happens to be running. The same holds
for a stream's close future, which asyncio sets to the error that broke the stream (a reset, a broken pipe).
Besides the noise, CPython 3.11 formats that log's traceback with `ast.parse`, and 3.11.7 fails an `ast.parse`
running at that moment with "SystemError: AST constructor recursion depth mismatch" (CPython gh-106905): an
unrelated import (pydantic's, wandb's) then fails. So every task and close future ends accounted for here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Iterable

logger = logging.getLogger(__name__)


async def together(*steps) -> None:
    """Run `steps` concurrently; the first failure cancels the others and is raised."""
    tasks = [asyncio.ensure_future(step) for step in steps]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
    finally:
        cancel_all(tasks)


def cancel_all(tasks: Iterable[asyncio.Future]) -> None:
    """Cancel `tasks`. The failure of one that ended, or that ends failing despite the cancel (a cancel that
    came as its wait ended: `asyncio.wait_for` in 3.11 then returns, and the task goes on), is taken and logged
    at debug level: the caller has already raised the first failure among them, or given up on all."""
    for task in tasks:
        if task.done():
            _take(task)
        else:
            task.cancel()
            task.add_done_callback(_take)


def keep(task: asyncio.Future, held: set[asyncio.Future]) -> asyncio.Future:
    """Hold `task` in `held` until it ends (asyncio keeps only a weak reference to a running task); a failure it
    ends with is a bug of ours, logged as an error."""
    held.add(task)
    task.add_done_callback(held.discard)
    task.add_done_callback(_report)
    return task


def _take(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.debug(f"a task given up on ended with {task.exception()!r}")


def _report(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("a background task failed", exc_info=task.exception())
