"""KV-aware P/D planning (policy ``kv_aware``, decision 045): D first, then P, partial transfers and
skipped prefills.

* D is picked first, by its cached prefix of the prompt against its load (multi-turn: the D that
  served the previous turn holds it).
* When D holds all but fewer than ``decode_local_prefill_tokens`` of the prompt, P is skipped: D
  gets the plain request and prefills the rest from its own prefix cache.
* Otherwise P is picked by its own cached prefix against its load, and P is told (``skip_blocks`` in
  ``kv_transfer_params``) not to send the leading blocks D holds. D checks on admission that it still
  holds them; if it evicted some since, it drops the transfer and prefills locally (correct, slower).

Event-loop thread only; no torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvwire.protocol.kv_params import Role
from kvwire.router.prompt_tokens import PromptTokenizer
from kvwire.router.request import ClientRequest
from kvwire.router.selection import Picked, Prefix, Selector

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushPlan:
    decode: Picked
    prefill: Picked | None  # None: P skipped, D prefills the remaining prompt tokens itself
    skip_blocks: int = 0  # leading prompt blocks D holds, which P does not send

    @property
    def partial(self) -> bool:
        return self.prefill is not None and self.skip_blocks > 0


def prefix_for(selector: Selector, tokenizer: PromptTokenizer, creq: ClientRequest) -> Prefix | None:
    """The request's prompt tokens, tokenized as the model's instances do (None: unknown)."""
    announced = ""
    for role in (Role.DECODE, Role.PREFILL, Role.BOTH):
        for view in selector.live_views(role, creq.model):
            if view.info.tokenizer:
                announced = view.info.tokenizer
                break
        if announced:
            break
    ids = tokenizer.token_ids(creq.path, creq.body, announced)
    if ids is None:
        return None
    creq.prompt_token_ids = ids
    return Prefix(tuple(ids))


def plan_push(
    selector: Selector, model: str | None, prefix: Prefix | None, decode_local_prefill_tokens: int
) -> PushPlan:
    """Pick D, then P (or no P); see the module docstring."""
    if prefix is None:
        d = selector.pick_for(Role.DECODE, model)
        return PushPlan(d, selector.pick_for(Role.PREFILL, model or d.view.info.model))
    # A D without the prefix still gets what the best P holds, less the hand-over (decision 101).
    via_p = selector.best_cached(Role.PREFILL, model, prefix) - selector.weights.handover_tokens
    d = selector.pick_for(Role.DECODE, model, prefix, floor_tokens=max(0, int(via_p)))
    model = model or d.view.info.model  # P must serve the model D serves
    n = len(prefix.token_ids)
    if d.cached_tokens > 0 and n - d.cached_tokens < decode_local_prefill_tokens:
        return PushPlan(d, None)
    p = selector.pick_for(Role.PREFILL, model, prefix)
    skip = 0
    if d.cached_tokens > 0 and d.block_size > 0:
        # At least the block holding the last prompt token travels (D needs the whole prompt's KV).
        skip = min(d.cached_tokens // d.block_size, (n - 1) // d.block_size)
    return PushPlan(d, p, skip)
