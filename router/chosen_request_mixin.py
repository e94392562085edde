"""Hand a replica to the request it was chosen for, not to the oldest waiting one.

Serve's ``FIFOMixin`` gives the replica a routing task found to the oldest waiting request.
For a router that picks replicas by prompt that is often the wrong request: a burst with
different prefixes gets its replicas shuffled, each prompt lands where another one's prefix
is cached and pushes that prefix out. Serve's default (match by internal request id) is no
answer either: the calls one HTTP request fans out to (several prompts, ``n``) share that
id, and the ones after the first are never matched and hang.

Each routing task routes one request at a time and calls ``choose_replicas`` for it from
within the task, so the router notes which request the current task is choosing for and,
when that task's replica is found, fulfils exactly that request. If it is already done
(cancelled), the replica goes to the oldest waiting request as before.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, RunningReplica


class ChosenRequestMixin(FIFOMixin):
    """Use with ``note_choice_for(pending_request)`` called from ``choose_replicas``."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._choosing_for: weakref.WeakKeyDictionary[asyncio.Task, PendingRequest] = weakref.WeakKeyDictionary()
        super().__init__(*args, **kwargs)

    def note_choice_for(self, pending_request: Optional[PendingRequest]) -> None:
        """Remember that the current routing task is choosing for ``pending_request``."""
        task = asyncio.current_task()
        if pending_request is not None and task is not None:
            self._choosing_for[task] = pending_request

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata: Any = None) -> None:
        task = asyncio.current_task()
        owner = self._choosing_for.pop(task, None) if task is not None else None
        if owner is None or owner.future.done():
            super()._fulfill_next_pending_request(replica, request_metadata)
            return
        self._record_queue_wait_time(owner)
        owner.future.set_result(replica)
        self._remove_pending_request_from_indices(owner)  # left in the FIFO deque: skipped there once done
