"""Aborting the requests of a caller that died (the ingress replica that relays their streams).

A client that disconnects cancels its response, and Serve cancels the replica's generator.
When the ingress replica itself dies, nothing cancels it: Ray does not cancel an actor task
whose caller died, so the engine would generate every such request to its end for no one.
The ingress therefore passes its own actor handle with each generation call; `CallerWatch`
pings the callers of running requests every PING_PERIOD_S and cancels the tasks of a caller
Ray reports dead (their `finally` blocks abort the engine requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorDiedError

logger = logging.getLogger(__name__)

PING_PERIOD_S = 1.0
PING_TIMEOUT_S = 10.0  # a busy caller is not a dead one: only ActorDiedError counts


@dataclass(frozen=True)
class Caller:
    """The calling replica: its actor id (hex) and handle."""

    actor_id: str
    handle: Any

    @classmethod
    def current(cls) -> Caller | None:
        """This process's actor (None outside an actor: nothing to watch). Outside Ray it asks
        nothing: the runtime context would start a local cluster."""
        if not ray.is_initialized():
            return None
        context = ray.get_runtime_context()
        actor_id = context.get_actor_id()
        return cls(actor_id, context.current_actor) if actor_id else None


class CallerWatch:
    def __init__(self) -> None:
        self._tasks: dict[str, tuple[Any, set[asyncio.Task]]] = {}  # actor id -> handle, tasks
        self._loop: asyncio.Task | None = None

    @contextlib.contextmanager
    def watch(self, caller: Caller | None, tasks: list[asyncio.Task]) -> Iterator[None]:
        """Cancel `tasks` if `caller` (None: not watched) dies meanwhile."""
        if caller is None:
            yield
            return
        key = caller.actor_id
        entry = self._tasks.setdefault(key, (caller.handle, set()))
        entry[1].update(tasks)
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._run())
        try:
            yield
        finally:
            entry[1].difference_update(tasks)
            if not entry[1] and self._tasks.get(key) is entry:
                del self._tasks[key]

    async def _run(self) -> None:
        while self._tasks:
            await asyncio.sleep(PING_PERIOD_S)
            for key, (caller, tasks) in list(self._tasks.items()):
                try:
                    await asyncio.wait_for(caller.__ray_ready__.remote(), PING_TIMEOUT_S)
                except ActorDiedError:
                    logger.warning("caller %s died: aborting its %d requests", key, len(tasks))
                    for task in tasks:
                        task.cancel()
                    self._tasks.pop(key, None)
                except Exception:  # noqa: BLE001 - slow or unreachable is not dead
                    continue
