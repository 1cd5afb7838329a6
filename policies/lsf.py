"""Least slack first: EDF that prices each request's remaining work and protects the
time per output token of running requests."""
from __future__ import annotations

from servelab._validate import check_float
from servelab.options import positive_float
from servelab.policies.base import Policy, PolicyFlag, register_policy
from servelab.policies.edf import DEFAULT_SLO_MS
from servelab.request import Request

DEFAULT_TPOT_SLO_MS = 200.0
"""The TPOT target of a request without one of its own: the batch tier of servelab's
default workload (`traces/data/default_workload.json`)."""
DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0
"""Prompt tokens per second the slack estimate charges: the order of one H100's prefill
throughput for an 8B model (`servelab cost step` shows what the cost model charges)."""


@register_policy("lsf")
class LeastSlackFirstPolicy(Policy):
    """The request's next deadline: its first token's, arrival + TTFT SLO; once it has
    drawn k tokens, its (k+1)-th token's, first_token_s + k · TPOT SLO (the pace that keeps
    its TPOT within the SLO). Slack = next deadline − now − the work it needs before that
    token (its prompt, plus the tokens drawn when a recompute preemption dropped them, at
    `prefill_tokens_per_s`). Requests without SLOs get `default_slo_ms` (TTFT, as edf)
    and `default_tpot_slo_ms`.

    Least slack first (the least-laxity-first rule: Mok, "Fundamental design problems of
    distributed systems for the hard-real-time environment", MIT PhD thesis, 1983) orders like EDF where every request needs the same work, and
    prefers, between two equal deadlines, the one with the longer prompt: it must start
    sooner to finish in time. `now` is common to every waiting request, so the order is the
    static key (next deadline − work, arrival_s, request_id).

    Victim: the running request with the most slack — the latest next deadline less the
    prefill it still has to compute — then the most recently admitted. A running request
    whose TPOT is at risk (its next token due soonest) is preempted last: a recompute
    preemption costs it its whole context again, which no TPOT SLO survives. Running
    requests already come before admissions in every step (decode-first composition), so
    that is where the TPOT protection lies; the policy never preempts for a waiting
    request.

    A separate policy, not an edf flag: its key, its victim rule and its flags all
    differ, and edf stays the plain rule its docstring proves a claim about.
    """

    victims_by_admission = False
    flags = (
        PolicyFlag("lsf-default-slo-ms", "default_slo_ms", "TTFT deadline in ms of requests "
                   "without an SLO of their own", parse=positive_float, metavar="MS"),
        PolicyFlag("lsf-default-tpot-slo-ms", "default_tpot_slo_ms", "TPOT target in ms of "
                   "requests without one of their own", parse=positive_float, metavar="MS"),
        PolicyFlag("lsf-prefill-tokens-per-s", "prefill_tokens_per_s", "prompt tokens per "
                   "second the slack estimate charges", parse=positive_float, metavar="R"),
    )

    def __init__(self, default_slo_ms: float = DEFAULT_SLO_MS,
                 default_tpot_slo_ms: float = DEFAULT_TPOT_SLO_MS,
                 prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S) -> None:
        super().__init__()
        o = "LeastSlackFirstPolicy"
        check_float(o, "default_slo_ms", default_slo_ms, 0.0, lo_open=True)
        check_float(o, "default_tpot_slo_ms", default_tpot_slo_ms, 0.0, lo_open=True)
        check_float(o, "prefill_tokens_per_s", prefill_tokens_per_s, 0.0, lo_open=True)
        self.default_slo_ms = float(default_slo_ms)
        self.default_tpot_slo_ms = float(default_tpot_slo_ms)
        self.prefill_tokens_per_s = float(prefill_tokens_per_s)

    def next_deadline(self, req: Request) -> float:
        """When the request's next token is due (seconds)."""
        drawn = req.num_output_tokens
        if req.first_token_s is None or drawn == 0:
            slo = req.slo_ttft_ms if req.slo_ttft_ms is not None else self.default_slo_ms
            return req.arrival_s + slo / 1e3
        tpot = req.slo_tpot_ms if req.slo_tpot_ms is not None else self.default_tpot_slo_ms
        return req.first_token_s + drawn * tpot / 1e3

    def work_s(self, req: Request) -> float:
        """Seconds of work the request needs before its next token: its tokens not yet
        computed (all of them while waiting; one while decoding)."""
        todo = max((s.num_tokens - s.num_computed_tokens for s in req.seqs if not s.finished),
                   default=0)
        return todo / self.prefill_tokens_per_s

    def waiting_key(self, req: Request) -> tuple:
        return (self.next_deadline(req) - self.work_s(req), req.arrival_s, req.request_id)

    def victim_key(self, req: Request, admit_seq: int) -> tuple:
        return (self.next_deadline(req) - self.work_s(req), admit_seq, req.request_id)

    def describe(self) -> dict:
        return {"name": self.name, "default_slo_ms": self.default_slo_ms,
                "default_tpot_slo_ms": self.default_tpot_slo_ms,
                "prefill_tokens_per_s": self.prefill_tokens_per_s}
