"""Shortest job first over predicted remaining output, with a starvation guard."""
from __future__ import annotations

import math
import random

from servelab._validate import check_choice, check_float
from servelab.policies.base import KeyedQueue, Policy, PolicyFlag, max_wait_flag, register_policy
from servelab.request import Request

PREDICTORS = ("oracle", "noisy", "prompt")


class OutputLengthPredictor:
    """Predicts a request's total output tokens.

    - oracle: the trace's true output length (the default in simulation);
    - noisy: the true length times a log-normal factor exp(N(0, sigma²)), drawn from a
      generator seeded by (seed, request_id), so a request's error is the same in every
      run and independent of the others;
    - prompt: a linear guess from the prompt length, a·prompt_len + b, at least 1.
    """

    def __init__(self, kind: str = "oracle", sigma: float = 0.5, seed: int = 0,
                 slope: float = 0.2, intercept: float = 64.0) -> None:
        check_choice("OutputLengthPredictor", "kind", kind, PREDICTORS)
        check_float("OutputLengthPredictor", "sigma", sigma, 0.0)
        self.kind, self.sigma, self.seed = kind, float(sigma), int(seed)
        self.slope, self.intercept = float(slope), float(intercept)
        self._cache: dict[int, float] = {}

    def __call__(self, req: Request) -> float:
        got = self._cache.get(req.request_id)
        if got is None:
            if self.kind == "oracle":
                got = float(req.output_len)
            elif self.kind == "noisy":
                rng = random.Random(self.seed * 1_000_003 + req.request_id)
                got = req.output_len * math.exp(rng.gauss(0.0, self.sigma))
            else:
                got = max(1.0, self.slope * req.prompt_len + self.intercept)
            self._cache[req.request_id] = got
        return got

    def describe(self) -> dict:
        d = {"predictor": self.kind}
        if self.kind == "noisy":
            d.update(sigma=self.sigma, seed=self.seed)
        elif self.kind == "prompt":
            d.update(slope=self.slope, intercept=self.intercept)
        return d


@register_policy("sjf")
class SJFPolicy(Policy):
    """Admit the request with the least predicted remaining output first.

    Key: (predicted remaining + aging_rate·arrival_s, arrival_s, request_id) — aging at
    `aging_rate` tokens per second of waiting, folded into a static key.

    Starvation guard (on by default): a request that has waited `max_wait_s` or more
    is overdue, and overdue requests are admitted before all others, oldest first. So
    no request is ever passed over by a later arrival once it is overdue.

    Victim: the running request with the longest predicted remaining output.
    """

    victims_by_admission = False
    order_moves = True
    flags = (
        PolicyFlag("sjf-predictor", "predictor", "output-length predictor", choices=PREDICTORS),
        max_wait_flag("sjf-max-wait-s"),
    )

    @classmethod
    def options_from_flags(cls, options: dict, seed: int) -> dict:
        """A noisy predictor draws its errors from the run's seed."""
        return {**options, "seed": seed} if options.get("predictor") == "noisy" else options

    def __init__(self, predictor: str = "oracle", sigma: float = 0.5, seed: int = 0,
                 aging_rate: float = 0.0, max_wait_s: float | None = 30.0) -> None:
        super().__init__()
        self.predict = OutputLengthPredictor(predictor, sigma=sigma, seed=seed)
        check_float("SJFPolicy", "aging_rate", aging_rate, 0.0)
        if max_wait_s is not None:
            check_float("SJFPolicy", "max_wait_s", max_wait_s, 0.0, lo_open=True)
        self.aging_rate = float(aging_rate)
        self.max_wait_s = max_wait_s
        self._by_arrival = KeyedQueue()

    def predicted_remaining(self, req: Request) -> float:
        return max(1.0, self.predict(req) - req.num_output_tokens)

    def waiting_key(self, req: Request) -> tuple:
        return (self.predicted_remaining(req) + self.aging_rate * req.arrival_s,
                req.arrival_s, req.request_id)

    def add(self, req: Request, now: float) -> None:
        super().add(req, now)
        self._by_arrival.push((req.arrival_s, req.request_id), req)

    def requeue(self, req: Request, now: float) -> None:
        super().requeue(req, now)
        self._by_arrival.push((req.arrival_s, req.request_id), req)

    def remove(self, req: Request) -> None:
        super().remove(req)
        self._by_arrival.remove(req)

    def peek(self, now: float) -> Request | None:
        if self.max_wait_s is not None:
            oldest = self._by_arrival.peek()
            if oldest is not None and now - oldest.arrival_s >= self.max_wait_s:
                return oldest
        return self._queue.peek()

    def candidates(self, now: float) -> list[Request]:
        heads = [self._queue.peek(), self._by_arrival.peek()]
        return [h for i, h in enumerate(heads) if h is not None and h not in heads[:i]]

    def waiting(self, now: float) -> list[Request]:
        ordered = self._queue.ordered()
        if self.max_wait_s is None:
            return ordered
        overdue = [r for r in self._by_arrival.ordered() if now - r.arrival_s >= self.max_wait_s]
        ids = {r.request_id for r in overdue}
        return overdue + [r for r in ordered if r.request_id not in ids]

    def victim_key(self, req: Request, admit_seq: int) -> tuple:
        return (self.predicted_remaining(req), req.request_id)

    def describe(self) -> dict:
        return {"name": self.name, **self.predict.describe(), "aging_rate": self.aging_rate,
                "max_wait_s": self.max_wait_s}
