"""Workloads of ``kvwire bench serve --workload``: prompts as *sessions* of turns.

* ``random``: independent random prompts of ``--input-len`` tokens (one turn each).
* ``shared-prefix``: ``--num-prefixes`` long system prompts (``--input-len`` tokens) x many short
  questions (``--suffix-len`` tokens); each request takes a random system prompt.
* ``multi-turn``: ``--num-prompts`` requests as conversations of ``--turns`` turns; turn 1 is
  ``--input-len`` tokens, each later turn is the previous prompt + the previous answer's tokens + a new
  ``--suffix-len``-token user message (so it is sent only once the previous turn has finished).

Token ids are drawn from 1..249 (inside every preset's vocabulary); a carried answer token outside
that range (a random-weight model can sample any id of its larger output layer) is folded into it
(:func:`carry_tokens`), like a re-tokenized answer that differs from the sampled ids.
Arrivals: a session starts at its offset (Poisson or fixed at ``--request-rate`` requests/s,
``inf`` = all at once).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import random


class Workload(str, enum.Enum):
    RANDOM = "random"
    SHARED_PREFIX = "shared-prefix"
    MULTI_TURN = "multi-turn"


@dataclasses.dataclass(frozen=True)
class Session:
    start_s: float  # offset from the start of the run
    turns: tuple[tuple[int, ...], ...]  # turn 1's prompt, then each later turn's new tokens
    carry: bool = False  # later turns extend the previous prompt and its answer (multi-turn)


def carry_tokens(token_ids: list[int]) -> tuple[int, ...]:
    """An answer's token ids as the next turn's prompt carries them (ids kept inside 1..249)."""
    return tuple(t if 1 <= t < 250 else t % 249 + 1 for t in token_ids)


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1, 250) for _ in range(n))


def _offsets(rng: random.Random, n: int, rate: float, arrival: str) -> list[float]:
    offsets, now = [], 0.0
    for _ in range(n):
        offsets.append(now)
        if math.isfinite(rate) and rate > 0:
            now += rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate
    return offsets


def make_sessions(args: argparse.Namespace) -> list[Session]:
    """The sessions of ``args.workload`` (validated: raises ValueError with a message)."""
    workload = Workload(args.workload)
    if min(args.num_prompts, args.input_len, args.output_len) <= 0:
        raise ValueError("--num-prompts, --input-len and --output-len must be > 0")
    rng = random.Random(args.seed)
    if workload is Workload.RANDOM:
        offsets = _offsets(rng, args.num_prompts, args.request_rate, args.arrival)
        return [Session(o, (_tokens(rng, args.input_len),)) for o in offsets]
    if args.suffix_len <= 0:
        raise ValueError("--suffix-len must be > 0")
    if workload is Workload.SHARED_PREFIX:
        if args.num_prefixes <= 0:
            raise ValueError("--num-prefixes must be > 0")
        prefixes = [_tokens(rng, args.input_len) for _ in range(args.num_prefixes)]
        offsets = _offsets(rng, args.num_prompts, args.request_rate, args.arrival)
        return [Session(o, (rng.choice(prefixes) + _tokens(rng, args.suffix_len),)) for o in offsets]
    if args.turns <= 0:
        raise ValueError("--turns must be > 0")
    num_sessions = max(1, args.num_prompts // args.turns)
    # conversations start at the request rate divided by their turns: about --request-rate requests/s
    offsets = _offsets(rng, num_sessions, args.request_rate / args.turns, args.arrival)
    later = args.turns - 1
    return [
        Session(o, (_tokens(rng, args.input_len), *(_tokens(rng, args.suffix_len) for _ in range(later))),
                carry=True)
        for o in offsets
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=[w.value for w in Workload], default=Workload.RANDOM.value,
                        help="prompt pattern (default %(default)s); see kvwire.bench.workloads")
    parser.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: system prompts")
    parser.add_argument("--suffix-len", type=int, default=32,
                        help="shared-prefix: question tokens; multi-turn: new tokens per later turn")
    parser.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every policy (--policies) or else every setup (--setups) this many "
                             "times, interleaved (the order rotates each round); the table adds the median "
                             "ratios over the rounds (to round robin; to the last setup named)")
