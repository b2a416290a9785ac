"""Hybrid-aware prefix cache: reuse full latent/indexer blocks by hash, and resume the KDA state
from a checkpoint at the same position.

Hash: block j's hash chains the previous block's hash with the block's token ids (and, when the
engine runs the MTP layer, the token after the block: the MTP row of a block's last position
is computed from it) and with the images whose placeholders fall in the block: each one's
digest (ImageInput.digest, which must identify its pixels and grid: the serving layer's is
their sha256) and offset from the block's start (vLLM's per-block "extra keys"). An image's
placeholders are all the same token id, so without the digests two prompts with the same text
and different images would share blocks; with them, the blocks before the image's first one are
shared, and the chain keeps every later block apart. The MTP pass embeds the token after the
block as a token (never as an image), so only placeholders inside the block count. The chain
starts from the engine's identity (model, dtype, expert quantisation, MTP), so a hash stands for
everything that determines the block's rows.

Images: a hit may end inside an image. The text model attends causally over image
placeholders, which keep the tokens' own positions, so splitting an image at any token computes
what the reference's one pass does (chunked prefill does the same): the rest of its
placeholders are prefilled with the matching rows of its embeddings, which the worker computes
from the whole image again (batch.py `_images`).

Checkpoints: a request's KDA state is copied into a spare state slot (state_checkpoints.py)
when its computed length reaches a block boundary that is (a) a multiple of
`checkpoint_interval` (long prefills; the scheduler cuts prefill chunks there), (b) the last
block boundary of its prompt, or (c) any block boundary after the prompt (decode: the newest
one replaces the request's previous decode checkpoint, so a finished turn leaves its final
block-aligned state). Every block boundary is also an indexer pool boundary (block_size is a
multiple of index_kpool), so the indexer's open pool is empty there: nothing else to save.

A new request resumes from the longest prefix that has both all its blocks cached and a
checkpoint at its end; at least one token is always computed (it yields the logits). Requests
asking for prompt logprobs compute their whole prompt (they still fill the cache).

Copies (slot -> checkpoint to save, checkpoint -> slot to restore) queue here and travel in
the next StepInput, where every rank applies them in order before the forward; a checkpoint
stays held until its copy has been handed to a step, so it is never evicted in between. With a
DFlash draft, each copy carries the slot's draft context ring along (the runner's).

Overlapped scheduling (engine.py): the next step is built, and its copies taken, before the
step in flight is read, so a request's counters (and its state when the queued copies run) are
a step ahead of what the engine has read. `after_step` then sees the position the step in
flight leaves, which is where the copy finds the state; a position whose tokens are not all
known yet (the in-flight step's samples or drafts) is never checkpointed, so a checkpoint
always stands for known tokens. `should_wait` compares with what the cache has recorded, not
with those counters.
Never touches tensors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from glm53.actors.step import ImageInput

from .block_pool import BlockPool
from .request import Request
from .state_checkpoints import CheckpointPool


def cache_identity(*parts: object) -> bytes:
    """The root of every hash chain: what else determines a block's rows (model, dtype, ...)."""
    return hashlib.sha256(repr(parts).encode()).digest()


def image_keys(images: Sequence[ImageInput], start: int, end: int) -> bytes:
    """What the block of positions start..end-1 adds to its hash for `images`: the digest and
    the offset from `start` of each image whose placeholders overlap it (b"" for none, so text
    blocks hash as without vision). The token ids before it have a fixed length, so the bytes
    cannot be confused with them."""
    return b"".join(repr((image.digest, image.offset - start)).encode() for image in images
                    if image.offset < end and image.offset + image.num_tokens > start)


@dataclass(frozen=True)
class PrefixHit:
    block_ids: list[int]
    checkpoint: int | None  # checkpoint index (None: no hit)
    num_tokens: int


NO_HIT = PrefixHit([], None, 0)


class PrefixCache:
    def __init__(self, blocks: BlockPool, checkpoints: CheckpointPool, checkpoint_slots,
                 identity: bytes, checkpoint_interval: int, hash_next_token: bool) -> None:
        """checkpoint_slots: checkpoint index -> state slot id (CachePlan.checkpoint_slot)."""
        if checkpoint_interval < 1 or checkpoint_interval % blocks.block_size:
            raise ValueError(f"checkpoint_interval {checkpoint_interval} must be a positive "
                             f"multiple of the block size {blocks.block_size}")
        self.blocks, self.checkpoints = blocks, checkpoints
        self.checkpoint_slots = checkpoint_slots
        self.identity, self.interval = identity, checkpoint_interval
        self.hash_next_token = hash_next_token
        self.bs = blocks.block_size
        self._hashes: dict[Request, list[bytes]] = {}
        self._registered: dict[Request, int] = {}  # leading blocks already cached
        self._decode_checkpoint: dict[Request, tuple[int, bytes]] = {}
        self._copies: list[tuple[int, int]] = []
        self._held: list[int] = []  # checkpoints the queued copies read or write
        # vLLM's counters, in tokens: looked up (prompt + output of each admission), served
        self.queries = 0
        self.hits = 0
        self.checkpoint_hits = 0  # admissions that resumed from a checkpoint

    # ----- hashing -----
    def hashes(self, request: Request) -> list[bytes]:
        """Hashes of the request's leading full blocks (as many as its known tokens allow)."""
        known = self._hashes.setdefault(request, [])
        extra = int(self.hash_next_token)
        end = (request.num_tokens - extra) // self.bs
        if len(known) < end:
            tokens = request.token_ids(len(known) * self.bs, end * self.bs + extra)
            prev = known[-1] if known else self.identity
            for j in range(end - len(known)):
                chunk = np.asarray(tokens[j * self.bs:(j + 1) * self.bs + extra], np.int64)
                first = len(known) * self.bs
                images = image_keys(request.images, first, first + self.bs)
                prev = hashlib.sha256(prev + chunk.tobytes() + images).digest()
                known.append(prev)
        return known

    # ----- admission -----
    def match(self, request: Request) -> PrefixHit:
        """The longest cached prefix of `request` with a checkpoint at its end."""
        if request.params.prompt_logprobs is not None:
            return NO_HIT
        hashes = self.hashes(request)[:(request.num_tokens - 1) // self.bs]
        found: list[int] = []
        for h in hashes:
            if (block := self.blocks.lookup(h)) is None:
                break
            found.append(block)
        for j in range(len(found), 0, -1):
            if (index := self.checkpoints.lookup(hashes[j - 1])) is not None:
                return PrefixHit(found[:j], index, j * self.bs)
        return NO_HIT

    def admit(self, request: Request, hit: PrefixHit) -> None:
        """Count the lookup; for a hit, hold its blocks and queue the state restore into the
        request's (already allocated) slot. The caller gives the request its other blocks."""
        self.queries += request.num_tokens
        request.num_cached_tokens = hit.num_tokens
        if hit.checkpoint is None:
            return
        self.hits += hit.num_tokens
        self.checkpoint_hits += 1
        self.blocks.touch(hit.block_ids)
        self._registered[request] = len(hit.block_ids)
        self.checkpoints.hold(hit.checkpoint)
        self._queue(self.checkpoint_slots(hit.checkpoint), request.state_slot, hit.checkpoint)
        request.num_computed_tokens = hit.num_tokens

    def should_wait(self, request: Request, running: list[Request]) -> bool:
        """Whether a running request's prefill will soon checkpoint a longer prefix of
        `request` than the cache holds now (n > 1 choices, identical parallel prompts, a
        shared system prompt): then `request` waits for it instead of computing the same
        prefix again."""
        if request.params.prompt_logprobs is not None:
            return False
        cacheable = (request.num_tokens - 1) // self.bs
        now = self.match(request).num_tokens
        mine = self.hashes(request)
        for other in running:
            # what the cache has recorded of `other` (its counters may be a step ahead: the
            # checkpoint of a step in flight is taken once the step before it is read)
            seen = self._registered.get(other, 0) * self.bs
            end = self._prompt_end(other)
            if seen >= end:
                continue  # no checkpoint of its prompt to come
            theirs = self.hashes(other)
            shared = 0
            while (shared < min(cacheable, end // self.bs, len(theirs), len(mine))
                   and theirs[shared] == mine[shared]):
                shared += 1
            # the last checkpoint position of `other` inside the shared blocks
            reach = shared * self.bs
            target = end if reach == end else reach // self.interval * self.interval
            if target > max(now, seen):
                return True
        return False

    def limit_chunk(self, request: Request, num_tokens: int, start: int | None = None) -> int:
        """Cut a prefill chunk (from `start`, default the computed tokens) at the request's
        next checkpoint position inside it."""
        start = request.num_computed_tokens if start is None else start
        end = self._prompt_end(request)
        if start >= end:
            return num_tokens
        stop = min(end, (start // self.interval + 1) * self.interval)
        return min(num_tokens, stop - start)

    def _prompt_end(self, request: Request) -> int:
        return len(request.prompt_ids) // self.bs * self.bs

    # ----- after a step, and when a request lets go of its slot and blocks -----
    def after_step(self, request: Request) -> None:
        """Cache the request's newly completed blocks; checkpoint its state if it stands at a
        checkpoint position. Call while it still holds its blocks and state slot."""
        if request.state_slot is None:
            return
        hashes = self.hashes(request)
        full = self._full_blocks(request)
        for j in range(self._registered.get(request, 0), full):
            self.blocks.cache(request.block_ids[j], hashes[j])
        self._registered[request] = max(full, self._registered.get(request, 0))
        block_hash = self._checkpoint_hash(request)
        if block_hash is None:
            return
        index = self.checkpoints.save(block_hash)
        if index is None:
            return
        self._queue(request.state_slot, self.checkpoint_slots(index), index)
        if request.num_computed_tokens > self._prompt_end(request):  # decode
            previous = self._decode_checkpoint.get(request)
            # unless evicted and reused since, the previous decode checkpoint is superseded
            if previous is not None and self.checkpoints.hash_of(previous[0]) == previous[1]:
                self.checkpoints.drop(previous[0])
            self._decode_checkpoint[request] = (index, block_hash)

    def checkpoint_due(self, request: Request) -> bool:
        """Whether `request` stands where after_step would take a checkpoint not cached yet
        (overlapped scheduling keeps it out of the next step until then: see engine.py)."""
        block_hash = self._checkpoint_hash(request)
        return block_hash is not None and self.checkpoints.lookup(block_hash) is None

    def _full_blocks(self, request: Request) -> int:
        """Leading blocks both computed and hashable (every token in them known)."""
        return min(request.num_computed_tokens // self.bs, len(self.hashes(request)),
                   len(request.block_ids))

    def _checkpoint_hash(self, request: Request) -> bytes | None:
        """The key of a checkpoint of the request's state at its computed position, or None
        where none is taken: not a checkpoint position, or a token before it not known yet
        (a placeholder: sampled, or a draft, by a step in flight)."""
        computed = request.num_computed_tokens
        if computed == 0 or computed % self.bs or computed // self.bs > self._full_blocks(
                request):
            return None
        end = self._prompt_end(request)
        if not (computed > end or computed % self.interval == 0 or computed == end):
            return None
        return self.hashes(request)[computed // self.bs - 1]

    def on_release(self, request: Request, finished: bool) -> None:
        """The request gives back its slot and blocks (finished, aborted or preempted)."""
        self.after_step(request)
        self._registered.pop(request, None)
        if finished:
            self._hashes.pop(request, None)
            self._decode_checkpoint.pop(request, None)

    def stats(self) -> dict[str, int]:
        """The EngineStats fields of the prefix cache."""
        return dict(prefix_cache_queries=self.queries, prefix_cache_hits=self.hits,
                    prefix_checkpoint_hits=self.checkpoint_hits,
                    prefix_checkpoint_evictions=self.checkpoints.num_evictions)

    # ----- copies for the workers -----
    def _queue(self, src: int, dst: int, index: int) -> None:
        self._copies.append((src, dst))
        self._held.append(index)

    def take_copies(self) -> np.ndarray | None:
        """The queued state copies for the next step ([C, 2] src, dst), or None."""
        if not self._copies:
            return None
        copies = np.asarray(self._copies, dtype=np.int64)
        for index in self._held:
            self.checkpoints.release(index)
        self._copies, self._held = [], []
        return copies
