"""Sampling: parameter checks, masks on hand-made distributions, per-sequence determinism."""
from __future__ import annotations

import math

import pytest
import torch

from servelab.backends.sampling import (SamplingParams, derive_seed, filter_logits,
                                        make_generator, sample)

PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1])


def kept(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> list[int]:
    out = filter_logits(logits[None], torch.tensor([top_k]), torch.tensor([top_p]))[0]
    return torch.nonzero(torch.isfinite(out)).flatten().tolist()


@pytest.mark.parametrize("top_k, top_p, expected", [
    (0, 1.0, [0, 1, 2, 3]),
    (2, 1.0, [0, 1]),
    (1, 1.0, [0]),
    (9, 1.0, [0, 1, 2, 3]),
    (0, 0.5, [0, 1]),      # mass above token 1 is 0.4 < 0.5; above token 2 it is 0.7
    (0, 0.4, [0]),         # mass above token 1 is 0.4, not < 0.4
    (0, 0.75, [0, 1, 2]),
    (0, 0.01, [0]),        # the most likely token always stays
    (2, 0.9, [0, 1]),      # top-k first, then top-p on the renormalised [4/7, 3/7]
    (3, 0.6, [0, 1]),      # after top-k: [4/9, 3/9, 2/9]; mass above token 1 = 0.44 < 0.6
])
def test_masks_on_a_hand_made_distribution(top_k, top_p, expected):
    assert kept(PROBS.log(), top_k, top_p) == expected
    # the order of the vocabulary does not matter
    perm = torch.tensor([2, 0, 3, 1])
    assert sorted(perm[kept(PROBS.log()[perm], top_k, top_p)].tolist()) == expected


def test_top_k_keeps_ties_at_the_boundary():
    assert kept(torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0]), top_k=2) == [1, 2, 3]


def test_greedy_is_argmax_and_needs_no_generator():
    logits = torch.tensor([[0.1, 2.0, -1.0], [5.0, 5.0, 1.0]])
    assert sample(logits, [SamplingParams()] * 2, [None, None]) == [1, 0]


def test_frequencies_follow_the_filtered_tempered_distribution():
    rows = 4000
    logits = PROBS.log().expand(rows, 4)
    params = [SamplingParams(temperature=2.0, top_k=3, seed=i) for i in range(rows)]
    tokens = sample(logits, params, [make_generator(p.seed) for p in params])
    counts = torch.bincount(torch.tensor(tokens), minlength=4).double() / rows
    tempered = PROBS[:3].double() ** 0.5
    expected = torch.cat([tempered / tempered.sum(), torch.zeros(1, dtype=torch.double)])
    assert counts[3] == 0
    # 4000 draws: standard error <= 0.008, so 0.03 is about 4 sigma
    assert torch.allclose(counts, expected, atol=0.03)


def decode_stream(seed: int, steps: int, mates: int) -> list[int]:
    """Draws `steps` tokens for one sequence (row `mates // 2`) among `mates` batch mates
    with their own parameters and streams."""
    logits_gen = torch.Generator().manual_seed(99)
    mate_params = [SamplingParams(temperature=0.7, top_p=0.9, seed=1000 + i) for i in range(mates)]
    mate_params[::3] = [SamplingParams()] * len(mate_params[::3])
    mine = SamplingParams(temperature=1.0, top_k=50, seed=seed)
    params = mate_params[: mates // 2] + [mine] + mate_params[mates // 2:]
    generators = [make_generator(p.seed) if p.seed is not None else None for p in params]
    out = []
    for _ in range(steps):
        logits = torch.randn(mates + 1, 128, generator=logits_gen)
        # my row sees the same logits whatever the batch size
        logits[mates // 2] = torch.randn(128, generator=torch.Generator().manual_seed(len(out)))
        out.append(sample(logits, params, generators)[mates // 2])
    return out


def test_tokens_depend_on_the_seed_not_on_batch_mates():
    alone = decode_stream(seed=7, steps=20, mates=0)
    assert decode_stream(seed=7, steps=20, mates=0) == alone
    assert decode_stream(seed=7, steps=20, mates=5) == alone
    assert decode_stream(seed=7, steps=20, mates=12) == alone
    assert decode_stream(seed=8, steps=20, mates=0) != alone


def test_random_rows_need_a_generator_and_shapes_must_agree():
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match=r"rows \[1\] sample randomly but have no generator"):
        sample(logits, [SamplingParams(), SamplingParams(temperature=1.0)], [None, None])
    with pytest.raises(ValueError, match="one SamplingParams and one generator per row"):
        sample(logits, [SamplingParams()], [None])


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": -3}, "seed"),
    ({"seed": True}, "seed"),
])
def test_bad_sampling_params_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_params_are_frozen():
    with pytest.raises(AttributeError):
        SamplingParams().temperature = 1.0  # type: ignore[misc]


def test_derived_seeds_are_deterministic_and_distinct():
    seeds = {derive_seed(0, r, s) for r in range(200) for s in range(4)}
    assert len(seeds) == 800 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(5, 17, 1) == derive_seed(5, 17, 1) != derive_seed(6, 17, 1)
