"""Prefix-affinity request routing of the LLM-server deployment (a Ray Serve `RequestRouter`).

With prefix caching on, a replica answers a prompt faster when it served one with the same
start (its engine holds those blocks and KDA state checkpoints, raycluster/prefix_cache.py).
The router therefore sends each chat or completion request to the replica its *routing key*
hashes to, and keeps load balanced by leaving that replica when its queue is much longer than
the least loaded one's.

- The routing key of a chat request is its messages up to and including the first user message
  (roles and text; image parts by a digest of their URL), of a completion request the start of
  its prompt; both cut at `prefix_chars` characters. Every turn of a conversation resends that
  start unchanged, so all turns go to one replica, while different conversations spread over
  the replicas.
- The key picks a replica by rendezvous (highest-random-weight) hashing over the replica ids:
  the same on every ingress replica and across calls without shared state, and a replica set
  change moves only the keys of the replicas that came or went.
- Load balance: queue lengths come from Serve's queue-length cache (probed when stale). When
  the preferred replica's queue exceeds the shortest by more than `imbalance_threshold`, or it
  is full or does not answer, the least-loaded replica is chosen (ties: hash order). Behind
  that choice Serve's power-of-two ranks follow, so a full replica never stalls a request.
- Requests without a prompt (health, metrics, model card, detokenize) route power-of-two.

Ray's `PrefixCacheAffinityRouter` (ray.serve.llm.request_router) does not fit this deployment:
it raises on every request without `prompt`/`messages` (our health, metrics and model-card
calls), reads only dict messages (ours are pydantic models: its text would be empty and its
match rate divide by zero), and blocks the router's event loop on a shared prefix-tree actor.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

logger = logging.getLogger("ray.serve")

PREFIX_CHARS = 1024  # characters of the routing key
IMBALANCE_THRESHOLD = 8  # queued requests the preferred replica may exceed the least loaded by


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def _content_text(content: Any) -> str:
    """The text of a message's content: a string, or text parts and image URLs of a list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            text = _field(part, "text")
            if isinstance(text, str):
                parts.append(text)
                continue
            image = _field(part, "image_url")
            url = _field(image, "url") if image is not None else None
            if isinstance(url, str):  # by digest: data: URLs of one format share a long start
                digest = hashlib.blake2b(url.encode(), digest_size=8).hexdigest()
                parts.append(f"<image {digest}>")
        return "".join(parts)
    return ""


def _messages_key(messages: Sequence[Any]) -> str:
    """Roles and text of the messages up to and including the first user message."""
    out = []
    for message in messages:
        role = _field(message, "role") or ""
        out.append(f"{role}\x00{_content_text(_field(message, 'content'))}\x01")
        if role == "user":
            break
    return "".join(out)


def _prompt_key(prompt: Any) -> str:
    """A completion prompt's text (or token ids); a batch routes by its first prompt."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return "ids:" + ",".join(map(str, prompt[:PREFIX_CHARS]))
        return _prompt_key(first)
    return ""


def routing_key(args: Sequence[Any], prefix_chars: int = PREFIX_CHARS) -> str | None:
    """The routing key of a request's positional arguments; None when it carries no prompt."""
    for arg in args:
        messages = _field(arg, "messages") if not isinstance(arg, str) else None
        if messages:
            key = "chat:" + _messages_key(messages)
            return key[:prefix_chars]
        prompt = _field(arg, "prompt") if not isinstance(arg, str) else None
        if prompt:
            key = _prompt_key(prompt)
            return ("text:" + key)[:prefix_chars] if key else None
    return None


def _weight(key: str, replica: str) -> int:
    digest = hashlib.blake2b(f"{replica}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, replicas: Sequence[str]) -> list[str]:
    """`replicas` by preference for `key`: highest-random-weight hashing, deterministic."""
    return sorted(replicas, key=lambda r: (_weight(key, r), r), reverse=True)


def pick_replica(order: Sequence[str], queue_lens: Mapping[str, int | None],
                 capacity: Mapping[str, int], imbalance_threshold: int) -> str:
    """The replica for a key whose preference is `order`: the first unless its queue (None:
    unknown) is full or exceeds the shortest by more than `imbalance_threshold`; then the
    least loaded (ties: preference order). With no queue length known, the first."""
    open_lens = {r: n for r in order if (n := queue_lens.get(r)) is not None
                 and n < capacity.get(r, n + 1)}
    if not open_lens:
        return order[0]
    least = min(open_lens.values())
    preferred = order[0]
    if preferred in open_lens and open_lens[preferred] - least <= imbalance_threshold:
        return preferred
    return min(open_lens, key=lambda r: (open_lens[r], order.index(r)))


class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Routes a request to the replica its prompt's start hashes to, load permitting (see
    the module docstring). No FIFOMixin: a routing task serves the request it chose for."""

    def initialize_state(self, prefix_chars: int = PREFIX_CHARS,
                         imbalance_threshold: int = IMBALANCE_THRESHOLD) -> None:
        self._prefix_chars = prefix_chars
        self._imbalance_threshold = imbalance_threshold

    async def _queue_lens(self, replicas: Sequence[RunningReplica]) -> dict[Any, int | None]:
        """Queue length per replica id: Serve's cache where fresh and open, else probed."""
        lens: dict[Any, int | None] = {}
        stale = []
        for r in replicas:
            n = (self._replica_queue_len_cache.get(r.replica_id)
                 if self._use_replica_queue_len_cache else None)
            if n is None or n >= r.max_ongoing_requests:
                stale.append(r)
            else:
                lens[r.replica_id] = n
        if stale:
            for r, n in await self._probe_queue_lens(stale, 0):
                lens[r.replica_id] = n
        return lens

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        fallback = await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self, candidate_replicas=candidate_replicas, pending_request=pending_request)
        if pending_request is None or len(candidate_replicas) < 2:
            return fallback
        try:
            key = routing_key(pending_request.args or (), self._prefix_chars)
        except Exception:  # an unexpected request shape must never fail routing
            logger.exception("prefix routing: no key for %s", pending_request.metadata)
            key = None
        if key is None:
            return fallback
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        order = rendezvous_order(key, list(by_id))
        lens = await self._queue_lens(candidate_replicas)
        chosen = pick_replica(
            order, {rid: lens.get(r.replica_id) for rid, r in by_id.items()},
            {rid: r.max_ongoing_requests for rid, r in by_id.items()},
            self._imbalance_threshold)
        return [[by_id[chosen]], *fallback]
