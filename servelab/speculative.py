"""Speculative decoding: what the scheduler reserves, and how many proposed tokens a
simulated verify step accepts.

A speculating sequence's decode step proposes K tokens (a draft model's K forwards, an
n-gram lookup, or an EAGLE / MTP head) and verifies them in one target forward of K + 1
tokens over its context; the target keeps the longest accepted prefix and samples one
token more, so a step produces between 1 and K + 1 tokens. The scheduler reserves K
lookahead KV slots per speculating sequence and counts K + 1 tokens of its budget, as vLLM
does (`num_lookahead_slots`, REFERENCE.md "Speculative decoding").

Acceptance (simulation): each proposed token is accepted with probability `acceptance`
(per token, independently, the model of Leviathan et al., 2023, "Fast Inference from
Transformers via Speculative Decoding", arXiv:2211.17192), so the tokens per target
forward average (1 − α^(K+1)) / (1 − α). Draws are a pure function of (seed, request,
position, index): a request accepts the same tokens whatever it is batched with, and
the same run gives the same answer. The real backend measures acceptance instead, by
rejection sampling against the target's own distribution.
"""
from __future__ import annotations

from servelab.config import SpeculativeConfig

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a 64-bit integer to a well-mixed one (Steele et al., 2014)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def accepted_tokens(seed: int, request_id: int, position: int, k: int, acceptance: float) -> int:
    """How many of the K tokens proposed at output `position` of a request the target
    accepts: the leading run of independent Bernoulli(acceptance) successes (0..k)."""
    if acceptance >= 1.0:
        return k
    if acceptance <= 0.0:
        return 0
    base = _mix(_mix(seed & _MASK) ^ request_id) ^ (position << 20)
    for j in range(k):
        if _mix(base + j) / 2.0**64 >= acceptance:
            return j
    return k


def expected_tokens_per_step(k: int, acceptance: float) -> float:
    """Tokens a verify step produces on average: (1 − α^(K+1)) / (1 − α), K + 1 at α = 1."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


__all__ = ["SpeculativeConfig", "accepted_tokens", "expected_tokens_per_step"]
