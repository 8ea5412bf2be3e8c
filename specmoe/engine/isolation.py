"""Finding the request that makes a batched operation fail, so that it fails alone.

An engine step runs one forward, one verification and one proposal for every request in the
batch. If one request's input makes such a batched call raise, every neighbour would fail
with it. `run_isolated` retries the call one request at a time and reports which requests
still fail: the engine fails only those and goes on with the others (the same idea as vLLM's
per-request error isolation; here applied per phase of the step). When every request fails
alone too, the fault is not any one request's: the original exception is raised and the
caller fails the step as a whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

logger = logging.getLogger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")


def run_isolated(batch_fn: Callable[[Sequence[Item]], Sequence[Result]],
                 one_fn: Callable[[Item], Result], items: Sequence[Item],
                 before_retry: Callable[[], None] | None = None
                 ) -> list[Result | Exception]:
    """`batch_fn(items)`, or, when it raises, `one_fn(item)` for each item.

    Args:
        batch_fn: the batched call; returns one result per item, in order.
        one_fn: the same call for a single item (its result equals that item's result in
            the batch; e.g. verification draws each row's randoms from its own generator).
        before_retry: undoes what the failed batched call may have consumed (e.g. restores
            the requests' generator states) so the retries give the batch's results.
    Returns:
        one entry per item: its result, or the exception it raised alone.
    Raises:
        the batched call's exception, when there is a single item or every item fails alone.
    """
    try:
        return list(batch_fn(items))
    except Exception as exc:
        if len(items) < 2:
            raise
        logger.warning("a batched call failed (%s: %s); retrying its %d requests one by one",
                       type(exc).__name__, exc, len(items))
        if before_retry is not None:
            before_retry()
        results = [_try(one_fn, item) for item in items]
        if all(isinstance(r, Exception) for r in results):
            raise
        return results


def _try(fn: Callable[[Item], Result], item: Item) -> Result | Exception:
    try:
        return fn(item)
    except Exception as exc:  # noqa: BLE001 - reported per item
        return exc
