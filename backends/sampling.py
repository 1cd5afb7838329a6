"""Token sampling: greedy, temperature, top-k, top-p, with one random stream per sequence.

Each non-greedy row draws exactly one uniform number from its own `torch.Generator` (a CPU
generator, so the stream is the same on every device) and picks its token by inverse-CDF
over the filtered distribution. A sequence's tokens therefore depend only on its logits,
its parameters and its own seed — never on which other sequences share the batch or on
how many draws they made.

Cost per step: one [S, V] softmax, plus one descending sort of [S, V] when some row uses
top-k or top-p, plus one scalar draw per non-greedy row on the host.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["SamplingParams", "make_generator", "derive_seed", "filter_logits", "sample",
           "probabilities", "draw"]

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    """0 means greedy (argmax, first index on ties); otherwise logits are divided by it."""
    top_k: int = 0
    """Keep the k most likely tokens (ties at the k-th logit kept too); 0 turns it off."""
    top_p: float = 1.0
    """Keep the smallest most-likely set whose probability reaches top_p; 1 turns it off."""
    seed: int | None = None
    """Seed of this request's random stream; None lets the executor derive one."""

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature < math.inf:
            raise ValueError("SamplingParams.temperature must be a finite float >= 0, "
                             f"got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 = off), "
                             f"got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed <= _MASK64):
            raise ValueError("SamplingParams.seed must be None or an int in [0, 2**64), "
                             f"got {self.seed!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def derive_seed(base_seed: int, request_id: int, sample_index: int = 0) -> int:
    """A well-mixed 63-bit seed for one sample of one request (splitmix64 finalizer over the
    three ints), for requests that bring no seed of their own."""
    x = (base_seed * 0x9E3779B97F4A7C15 + request_id * 0xBF58476D1CE4E5B9
         + sample_index * 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def make_generator(seed: int) -> torch.Generator:
    """The CPU random stream of one sequence."""
    return torch.Generator(device="cpu").manual_seed(seed)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Logits [S, V] with tokens outside each row's top-k / top-p set set to -inf.

    top_k [S] int64 (0 = off), top_p [S] float (1 = off), on the logits' device. Ties at the
    k-th largest logit are all kept; top-p keeps a token when the probability of the tokens
    ranked strictly above it is below top_p (so the most likely token always stays)."""
    sorted_logits, _ = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    keep = logits >= kth
    probs = torch.softmax(sorted_logits.masked_fill(sorted_logits < kth, float("-inf")), dim=-1)
    mass_above = torch.cumsum(probs, dim=-1) - probs
    in_nucleus = (mass_above < top_p[:, None]) | (top_p[:, None] >= 1.0)
    # Smallest logit still inside the nucleus: everything at or above it stays.
    cutoff = sorted_logits.masked_fill(~in_nucleus, float("inf")).amin(dim=-1, keepdim=True)
    keep &= logits >= cutoff
    return logits.masked_fill(~keep, float("-inf"))


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of logits [S, V]; row i uses params[i] and draws from generators[i]
    (may be None for a greedy row)."""
    num_rows = logits.shape[0]
    if logits.dim() != 2 or len(params) != num_rows or len(generators) != num_rows:
        raise ValueError(f"sample: logits must be [S, V] with one SamplingParams and one generator "
                         f"per row; got logits {tuple(logits.shape)}, {len(params)} params, "
                         f"{len(generators)} generators")
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if random_rows:
        missing = [i for i in random_rows if generators[i] is None]
        if missing:
            raise ValueError(f"sample: rows {missing[:5]} sample randomly but have no generator")
        rows = torch.tensor(random_rows, device=logits.device)
        probs = probabilities(logits[rows], [params[i] for i in random_rows])
        tokens[rows] = draw(probs, [generators[i] for i in random_rows])
    return tokens.tolist()


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row of logits [S, V] samples from, [S, V] float64: the softmax
    of the logits over the row's temperature, zero outside its top-k / top-p set. Rows
    must not be greedy (temperature 0 has no distribution but argmax)."""
    device = logits.device
    scaled = logits.float() / torch.tensor([p.temperature for p in params], device=device)[:, None]
    if any(p.top_k or p.top_p < 1.0 for p in params):
        scaled = filter_logits(scaled, torch.tensor([p.top_k for p in params], device=device),
                               torch.tensor([p.top_p for p in params], device=device))
    return torch.softmax(scaled, dim=-1, dtype=torch.float64)


def draw(weights: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token id per row of non-negative weights [S, V] float64 (any positive total,
    normalised here), by inverse CDF over one uniform drawn from the row's generator;
    int64 [S] on the weights' device."""
    cdf = torch.cumsum(weights, dim=-1)
    total = cdf[:, -1:].contiguous()
    uniforms = torch.cat([torch.rand(1, generator=g, dtype=torch.float64)
                          for g in generators]).to(weights.device)
    picked = torch.searchsorted(cdf, uniforms[:, None] * total, right=True)
    # u * total may round up to total: fall back to the last token with probability mass.
    last_with_mass = torch.searchsorted(cdf, total)
    return torch.minimum(picked, last_with_mass)[:, 0]
