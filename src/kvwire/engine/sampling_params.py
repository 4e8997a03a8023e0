"""Per-request sampling parameters (frozen, validated: bad values raise InvalidRequestError)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvwire.errors import InvalidRequestError

GREEDY_TEMPERATURE = 1e-5


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # output tokens at most (the model length may end a request earlier)
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # per-request torch.Generator seed; None = the engine's generator
    stop: Sequence[str] = ()  # stop strings: the text ends before the first match
    stop_token_ids: Sequence[int] = ()  # tokens that end the request (kept in token_ids)
    ignore_eos: bool = False
    # The last N prompt tokens are this answer's own earlier output (an answer migrated from a dead
    # instance, decision 052): detokenization and stop strings continue from them, so the text
    # equals an uninterrupted run's even across a character split by the migration.
    prior_output_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0.0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise InvalidRequestError("stop must be a list of non-empty strings")
        stop_ids = tuple(self.stop_token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_ids):
            raise InvalidRequestError("stop_token_ids must be a list of non-negative integers")
        prior = self.prior_output_tokens
        if isinstance(prior, bool) or not isinstance(prior, int) or prior < 0:
            raise InvalidRequestError(f"prior_output_tokens must be an integer >= 0, got {prior!r}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", stop_ids)

    @property
    def greedy(self) -> bool:
        """Temperatures this close to 0 are greedy (dividing by them would overflow)."""
        return self.temperature < GREEDY_TEMPERATURE
