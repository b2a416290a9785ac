"""Engine counters: speculative-decoding acceptance, and the snapshot the serving layer exports."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's scheduler and ledgers (read by metrics and load shedding)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable KV blocks handed out
    state_slot_usage: float = 0.0  # fraction of KDA state slots handed out
    num_preemptions: int = 0  # cumulative
    # speculative decoding, cumulative (vLLM meanings): verify steps that carried drafts,
    # draft tokens proposed, draft tokens accepted, accepted tokens by draft position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # capacity of the paged cache on one rank (follows the KV cache dtype)
    kv_cache_tokens_per_gib: float = 0.0
    spec_draft_tokens_per_pos: tuple[int, ...] = ()  # drafts verified, by draft position
    # steps by the draft length they chose (index = drafts per sequence; adaptive mode)
    spec_draft_length_steps: tuple[int, ...] = ()
    # prefix caching, cumulative (vLLM's counters, in tokens): looked up and served from the
    # cache; admissions that resumed from a KDA checkpoint; checkpoints overwritten
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_checkpoint_hits: int = 0
    prefix_checkpoint_evictions: int = 0


class SpecStats:
    """Speculative decoding counters: drafts proposed / accepted, per draft position."""

    def __init__(self, num_spec: int) -> None:
        self.num_drafts = 0
        self.num_accepted = 0
        self.num_verify_steps = 0  # request-steps that verified at least one draft
        self.accepted_per_position = [0] * num_spec
        self.drafts_per_position = [0] * num_spec
        self.steps_by_draft_length = [0] * (num_spec + 1)  # adaptive mode: the choice per step

    def record_draft_length(self, width: int) -> None:
        self.steps_by_draft_length[width] += 1

    def record(self, items, accepted: list[int] | None) -> None:
        if accepted is None:
            return
        for item, a in zip(items, accepted, strict=True):
            if not item.num_drafts or not item.samples:
                continue
            self.num_verify_steps += 1
            self.num_drafts += item.num_drafts
            self.num_accepted += a
            for j in range(item.num_drafts):
                self.drafts_per_position[j] += 1
                self.accepted_per_position[j] += int(j < a)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the target's own token)."""
        return 1 + self.num_accepted / self.num_verify_steps if self.num_verify_steps else 0.0
