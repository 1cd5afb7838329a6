"""Speculative decoding in the simulator: what a verify step costs, and what it produces.

A speculating sequence's decode arrives from the scheduler as one entry of q = K' + 1
tokens over its context c (`ScheduledSeq.num_tokens` > 1, not a prefill; K' <= K near
the end of a request). The step then costs

- the target's verify pass: the q tokens of every speculating sequence run through the
  model like a prefill chunk of q tokens over c cached ones (their GEMM rows, and
  attention of q queries against c + q keys), beside the step's other work: this is how
  vLLM runs verification, as queries of length K + 1 in its attention backends;
- the proposer's K' forwards before it (the longest K' in the batch), each over the
  sequences still proposing: a draft model priced by its own cost model as a decode step
  of those sequences at their growing contexts; an EAGLE head or an MTP layer as one
  decoder layer of the target's shape with the target's LM head; an n-gram lookup as
  free (it runs on the CPU, in the scheduler's shadow). Proposer forwards run inside the
  target's step, so they add their kernels' time but not another step overhead.

A verify step produces 1 + a tokens, a the accepted prefix drawn by
`servelab.speculative.accepted_tokens` from the request's acceptance rate (its tenant's,
else the global one). `StepResult.produced` carries it to the scheduler, which advances
the sequence by that many tokens and keeps the rejected positions' slots as lookahead.

The step record counts a verify entry as one decoding sequence (its `decode_context_sum`
as c + 1), so steps.csv reads as the engine's batch; the pricing shape above is internal.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from servelab.config import SpeculativeConfig
from servelab.models import ModelSpec, load_model_spec
from servelab.outputs import BatchShape, SchedulerOutput, StepResult
from servelab.speculative import accepted_tokens
from servelab.simulator.cost_model import CostModel


def proposer_spec(config: SpeculativeConfig, target: ModelSpec) -> ModelSpec | None:
    """The model the proposer runs (None: an n-gram lookup, which runs no model). A draft
    must share the target's vocabulary and be no larger than it (the same model as its own
    draft accepts every token: a check, as the real backend uses it); one line says why not."""
    if config.method == "ngram":
        return None
    if config.method == "draft":
        draft = load_model_spec(config.draft_model)
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"draft model {draft.name} has a vocabulary of {draft.vocab_size:,} tokens, "
                             f"the target {target.name} one of {target.vocab_size:,}: a draft must share "
                             "the target's vocabulary")
        if draft.num_params > target.num_params:
            raise ValueError(f"draft model {draft.name} ({draft.num_params / 1e9:.1f}B parameters) is larger "
                             f"than the target {target.name} ({target.num_params / 1e9:.1f}B)")
        return draft
    if config.method == "mtp" and target.architecture not in MTP_ARCHITECTURES:
        raise ValueError(f"--speculative mtp needs a model with multi-token-prediction layers "
                         f"(`num_nextn_predict_layers`: DeepSeek-V3); {target.name} "
                         f"({target.architecture}) has none: use eagle, ngram or draft:MODEL")
    # EAGLE / MTP: one decoder layer of the target's shape, through the target's LM head;
    # a mixture-of-experts target's is one of its MoE layers (DeepSeek-V3's MTP layer is:
    # its model card), not one of its dense leading layers' indices past the head's one
    moe = replace(target.moe, dense_layers=()) if target.moe is not None else None
    return replace(target, num_layers=1, moe=moe, name=f"{target.name} {config.method} head")


MTP_ARCHITECTURES = frozenset({"DeepseekV3ForCausalLM"})
"""The architectures servelab reads whose checkpoints carry multi-token-prediction layers
that vLLM runs as the `mtp` proposer (`SpeculativeConfig.hf_config_override`,
vllm/config/speculative.py: deepseek_v3 -> DeepSeekMTPModel; vLLM also has MTP for
GLM-4.5, MiMo, Qwen3-Next and others, which servelab's loader does not read). The check is
by architecture: a DeepSeek-V3-shaped config whose `num_nextn_predict_layers` is 0 is not
told apart."""


@dataclass
class SpeculationStats:
    """Per request: decode steps (verify steps, and plain ones where no token was
    proposed: a request's last token, or above the batch limit), tokens proposed, tokens
    accepted."""

    steps: dict[int, int] = field(default_factory=dict)
    proposed: dict[int, int] = field(default_factory=dict)
    accepted: dict[int, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        steps, proposed, accepted = (sum(d.values()) for d in (self.steps, self.proposed, self.accepted))
        return {"decode_steps": steps, "proposed_tokens": proposed, "accepted_tokens": accepted,
                "acceptance_rate": accepted / proposed if proposed else None,
                "tokens_per_decode_step": (steps + accepted) / steps if steps else None,
                "requests": [{"request_id": rid, "decode_steps": n, "proposed": self.proposed[rid],
                              "accepted": self.accepted[rid]} for rid, n in sorted(self.steps.items())]}


class SpeculativeExecutor:
    """The simulated executor of a speculating engine (`SimulatedExecutor` without
    speculation): prices verify and proposer work, draws acceptance."""

    def __init__(self, cost_model: CostModel, config: SpeculativeConfig, seed: int,
                 acceptance: Mapping[int, float], proposer: CostModel | None) -> None:
        self.cost_model = cost_model
        self.config = config
        self.seed = seed
        self.acceptance = acceptance
        """request id -> per-token acceptance rate."""
        self.proposer = proposer
        self.stats = SpeculationStats()

    def execute(self, output: SchedulerOutput) -> StepResult:
        shape = BatchShape.from_output(output)
        stats, default = self.stats, self.config.acceptance
        produced, verify = {}, []
        for e in output.scheduled:
            if e.is_prefill:
                continue
            rid, k = e.request_id, e.num_tokens - 1
            a = 0
            if k:
                verify.append(e)
                a = accepted_tokens(self.seed, rid, e.context_len, k, self.acceptance.get(rid, default))
                produced[e.seq_id] = a + 1
            stats.steps[rid] = stats.steps.get(rid, 0) + 1
            stats.proposed[rid] = stats.proposed.get(rid, 0) + k
            stats.accepted[rid] = stats.accepted.get(rid, 0) + a
        if not verify:
            return StepResult(self.cost_model.step_time(shape), shape=shape)
        duration = self.cost_model.step_time(_pricing_shape(shape, verify)) + self._proposer_time(verify)
        return StepResult(duration, shape=shape, produced=produced)

    def _proposer_time(self, verify) -> float:
        """K' forwards of the proposer over the sequences still proposing (see the module
        docstring); 0 for an n-gram lookup."""
        if self.proposer is None:
            return 0.0
        overhead = self.proposer.step_overhead_s
        total = 0.0
        for j in range(max(e.num_tokens - 1 for e in verify)):
            active = [e for e in verify if e.num_tokens - 1 > j]
            shape = BatchShape(num_decode_seqs=len(active),
                               decode_context_sum=sum(e.context_len + 1 + j for e in active))
            total += self.proposer.step_time(shape) - overhead
        return total


def _pricing_shape(shape: BatchShape, verify) -> BatchShape:
    """`shape` with each verify entry moved from the decodes to the prefill chunks."""
    n = len(verify)
    q = sum(e.num_tokens for e in verify)
    c = sum(e.context_len for e in verify)
    return replace(
        shape, num_decode_seqs=shape.num_decode_seqs - n,
        decode_context_sum=shape.decode_context_sum - c - n,
        num_prefill_seqs=shape.num_prefill_seqs + n, num_prefill_tokens=shape.num_prefill_tokens + q,
        prefill_context_sum=shape.prefill_context_sum + c,
        prefill_q_context_sum=shape.prefill_q_context_sum + sum(e.num_tokens * e.context_len for e in verify),
        prefill_q_sq_sum=shape.prefill_q_sq_sum + sum(e.num_tokens * e.num_tokens for e in verify),
        prefill_max_keys=max(shape.prefill_max_keys, max(e.context_len + e.num_tokens for e in verify)))
