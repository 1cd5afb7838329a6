"""Speculative decoding on the real backend: proposers, rejection sampling, acceptance counts.

The scheduler (`Scheduler._schedule_verify`) gives a speculating sequence a decode entry of
q = K' + 1 tokens at context c, with KV slots reserved for positions c .. c + K'. The
executor asks a proposer for K' tokens after the sequence's last sampled token, runs the
target once over [last, d1 .. dK'] (a chunk with context, its KV written for every
position), and keeps what `rejection_sample` returns: the accepted prefix of the proposal
and one token more. Rejected positions hold stale KV that the next step overwrites.

Rejection sampling (Leviathan et al., 2023, arXiv:2211.17192, Algorithm 1; Chen et al.,
2023, arXiv:2302.01318): proposed token x, drawn from the proposer's q, is accepted with
probability min(1, p(x) / q(x)), where p is the target's distribution at that position
(after temperature, top-k and top-p: exactly what plain decoding samples from); at the
first rejection the token is drawn from norm(max(0, p - q)) and the step ends; when all
are accepted one more is drawn from the target's next p. Each produced token is then
distributed as p, whatever the proposer. A deterministic proposer (n-gram) has q = one-hot.
With greedy decoding this is: accept while the proposal equals the target's argmax, then
the argmax — the tokens plain greedy decoding produces.

Random draws come from the sequence's own generator (`sampling.make_generator`) in a
fixed order — the draft's K' draws, then K' acceptance uniforms, then one draw for the
token after them — so a request's tokens depend on its seed alone, not on its batch.

Proposers:

- `DraftProposer`: a smaller model of the target's vocabulary with its own paged KV cache
  of the same blocks, addressed by the same block tables. It runs every prefill chunk the
  target runs (so blocks the prefix cache shares hold its KV too), and at a verify step
  first the tokens it has not seen (the last sampled token, and after a fully accepted
  step the last proposal too), then K' - 1 single-token decodes.
- `NgramProposer`: prompt lookup — the latest earlier occurrence of the sequence's last n
  tokens (n from 4 down to 1), proposing the tokens that followed it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

import torch

from servelab.backends.attention import SeqWork
from servelab.backends.model import ModelRunner, check_model_supported, sliding_window
from servelab.backends.sampling import SamplingParams, draw, probabilities
from servelab.config import SpeculativeConfig
from servelab.models import ModelSpec, load_model_spec
from servelab.request import SeqId

__all__ = ["REAL_METHODS", "VerifyTask", "Proposal", "Proposer", "DraftProposer",
           "NgramProposer", "AcceptanceCounts", "verify_greedy", "rejection_sample",
           "draft_spec", "draft_checkpoint", "build_proposer", "ngram_lookup"]

REAL_METHODS = ("draft", "ngram")
"""The proposers the real backend runs (EAGLE and MTP heads are simulation-only)."""

NGRAM_MAX, NGRAM_MIN = 4, 1
"""Longest and shortest suffix the n-gram proposer looks up (vLLM's documented example
sets prompt_lookup_max to 4)."""


# --------------------------------------------------------------------------- records


@dataclass(slots=True)
class VerifyTask:
    """One speculating sequence's share of a step, as a proposer sees it: its last sampled
    token sits at position `context_len` (KV not yet computed), and it may propose up to
    `num_proposals` tokens after it into the reserved slots of `block_table`."""

    seq_id: SeqId
    context_len: int
    num_proposals: int
    block_table: list[int]
    prompt: Sequence[int]
    outputs: Sequence[int]
    generator: torch.Generator | None

    def tokens(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of the sequence (the prompt, then its outputs)."""
        p = len(self.prompt)
        if stop <= p:
            return list(self.prompt[start:stop])
        if start >= p:
            return list(self.outputs[start - p:stop - p])
        return list(self.prompt[start:]) + list(self.outputs[:stop - p])


@dataclass(slots=True)
class Proposal:
    tokens: list[int]
    """Proposed token ids (at most the task's num_proposals; may be empty)."""
    probs: torch.Tensor | None = None
    """[len(tokens), V] float64: the distribution each token was drawn from; None for a
    deterministic proposer (and under greedy decoding, where it is not needed)."""


@dataclass(slots=True)
class AcceptanceCounts:
    """One request's speculation: decode steps (each sample's; as the simulator counts
    them), verify steps among them (at least one token proposed), tokens proposed, and
    tokens of them accepted."""

    decode_steps: int = 0
    verify_steps: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None


# --------------------------------------------------------------------------- verification


def verify_greedy(target_logits: torch.Tensor, proposed: list[int]) -> list[int]:
    """Greedy verification over target logits [k + 1, V] of the positions [last, d1..dk]:
    the proposed tokens while each equals the target's argmax (first index on ties, as
    `sampling.sample`), then the argmax after them."""
    best = target_logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for token, choice in zip(proposed, best):
        if token != choice:
            break
        out.append(token)
    out.append(best[len(out)])
    return out


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     proposed: list[int], generator: torch.Generator) -> list[int]:
    """The tokens one verify step produces (see the module docstring): target_probs
    [k + 1, V] the target's distributions at [last, d1..dk], draft_probs [k, V] the
    proposer's (None: deterministic proposals, q one-hot). Draws k uniforms, then one
    token; returns the accepted proposals and one token more (1 to k + 1 tokens)."""
    k = len(proposed)
    if target_probs.shape[0] != k + 1 or (draft_probs is not None and draft_probs.shape[0] != k):
        raise ValueError(f"rejection_sample: {k} proposed tokens need {k + 1} target rows and "
                         f"{k} draft rows, got {tuple(target_probs.shape)} and "
                         f"{None if draft_probs is None else tuple(draft_probs.shape)}")
    index = torch.tensor(proposed, dtype=torch.int64, device=target_probs.device)
    rows = torch.arange(k, device=target_probs.device)
    p = target_probs[rows, index].cpu()
    q = draft_probs[rows, index].cpu() if draft_probs is not None else torch.ones(k, dtype=p.dtype)
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64)
    rejected = (uniforms * q >= p).nonzero()   # accept with probability min(1, p / q)
    accepted = int(rejected[0]) if len(rejected) else k
    if accepted == k:
        residual = target_probs[k]
    else:
        if draft_probs is not None:
            residual = (target_probs[accepted] - draft_probs[accepted]).clamp(min=0)
        else:
            residual = target_probs[accepted].clone()
            residual[proposed[accepted]] = 0
        if not residual.sum() > 0:   # p == q up to rounding: a rejection is then measure-zero
            residual = target_probs[accepted]
    return proposed[:accepted] + [int(draw(residual[None], [generator])[0])]


# --------------------------------------------------------------------------- proposers


class Proposer(Protocol):
    runners: tuple[ModelRunner, ...]
    """Model runners whose KV caches follow the scheduler's block tables: the executor
    applies every block move (swap, copy, offload, load) to them as to the target."""

    def propose(self, prefills: list[tuple[SeqId, SeqWork]], tasks: list[VerifyTask],
                params: SamplingParams) -> list[Proposal]:
        """One proposal per task; `prefills` are the step's prefill chunks (the target's
        own SeqWork of each), for proposers that keep KV."""

    def release(self, seq_id: SeqId) -> None:
        """Forget a finished sequence."""


def _choose(logits: torch.Tensor, tasks: list[VerifyTask],
            params: SamplingParams) -> tuple[list[int], torch.Tensor | None]:
    """The draft's tokens for the rows of logits [S, V] (argmax, or one draw from each
    task's generator) and the distributions drawn from (None when greedy)."""
    if params.is_greedy:
        return logits.argmax(dim=-1).tolist(), None
    probs = probabilities(logits, [params] * len(tasks))
    return draw(probs, [t.generator for t in tasks]).tolist(), probs


class DraftProposer:
    """A draft model with its own paged KV cache under the target's block tables.

    `_seen[seq]` is how many leading positions of a sequence the draft has written KV for.
    A prefill chunk sets it to the chunk's end, a verify step at context c to c + K'
    (positions c .. c + K' - 1). Below the sequence's next context those hold the real
    tokens (the last sampled one and the accepted proposals); above it, rejected proposals,
    which the next step rewrites — so the next step starts at min(_seen, context): its
    last sampled token, preceded after a fully accepted step by the last proposal, and
    after plain decodes (no proposal) by the tokens they added. Cost per verify step: K'
    draft forwards over the batch of speculating sequences (the first a short chunk),
    plus the draft's share of the prefills."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.runners = (runner,)
        self._seen: dict[SeqId, int] = {}

    def propose(self, prefills: list[tuple[SeqId, SeqWork]], tasks: list[VerifyTask],
                params: SamplingParams) -> list[Proposal]:
        catch_up = []
        for t in tasks:
            # (every sequence prefills before it verifies, so it has a record)
            start = min(self._seen.get(t.seq_id, t.context_len), t.context_len)
            stop = t.context_len + 1
            catch_up.append(SeqWork(t.tokens(start, stop), start, t.block_table, stop - start > 1))
        works = [w for _, w in prefills] + catch_up
        if not works:
            return []
        for sid, w in prefills:
            self._seen[sid] = w.seq_len
        logits = self.runner.run(works)[len(prefills):]   # after each task's last token
        proposals = [Proposal([]) for _ in tasks]
        rows: list[list[torch.Tensor]] = [[] for _ in tasks]
        for r in range(max((t.num_proposals for t in tasks), default=0)):
            live = [i for i, t in enumerate(tasks) if t.num_proposals > r]
            if r:   # one more token of each still proposing task
                logits = self.runner.run([SeqWork([proposals[i].tokens[-1]],
                                                  tasks[i].context_len + r,
                                                  tasks[i].block_table, False) for i in live])
            else:
                logits = logits[live]
            tokens, probs = _choose(logits, [tasks[i] for i in live], params)
            for j, i in enumerate(live):
                proposals[i].tokens.append(tokens[j])
                if probs is not None:
                    rows[i].append(probs[j])
        for t, proposal, drawn in zip(tasks, proposals, rows):
            self._seen[t.seq_id] = t.context_len + len(proposal.tokens)
            if drawn:
                proposal.probs = torch.stack(drawn)
        return proposals

    def release(self, seq_id: SeqId) -> None:
        self._seen.pop(seq_id, None)


class NgramProposer:
    """Prompt lookup: no model, no KV. Cost per task: O(sequence length x NGRAM_MAX) token
    comparisons on the host."""

    runners: tuple[ModelRunner, ...] = ()

    def propose(self, prefills: list[tuple[SeqId, SeqWork]], tasks: list[VerifyTask],
                params: SamplingParams) -> list[Proposal]:
        return [Proposal(ngram_lookup(t.tokens(0, t.context_len + 1), t.num_proposals))
                for t in tasks]

    def release(self, seq_id: SeqId) -> None:
        pass


def ngram_lookup(tokens: list[int], k: int, max_n: int = NGRAM_MAX,
                 min_n: int = NGRAM_MIN) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last n
    tokens, for the longest n in [min_n, max_n] that occurs; [] when none does."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        for start in range(size - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


# --------------------------------------------------------------------------- setup


def draft_checkpoint(name: str) -> str | None:
    """The draft's weights: a folder holding safetensors is a checkpoint; anything else
    (a catalog name, a config.json) gets seeded random weights."""
    folder = Path(name)
    return name if folder.is_dir() and any(folder.glob("*.safetensors")) else None


def draft_spec(config: SpeculativeConfig, target: ModelSpec, max_model_len: int) -> ModelSpec | None:
    """Checks that the real backend can run `config` against `target` and returns the
    draft model's spec (None for a proposer without a model). Raises ValueError, in one
    line that says what to change."""
    if config.method not in REAL_METHODS:
        raise ValueError(f"--speculative {config.method}: the real backend runs draft:MODEL and "
                         f"ngram; {config.method} is simulation-only (servelab simulate)")
    if config.method != "draft":
        return None
    try:
        spec = load_model_spec(config.draft_model)
        check_model_supported(spec)
    except (ValueError, OSError) as exc:
        raise ValueError(f"draft model {config.draft_model!r}: {exc}") from None
    if spec.vocab_size != target.vocab_size:
        raise ValueError(f"draft model {spec.name} has a vocabulary of {spec.vocab_size} tokens, "
                         f"the target {target.name} {target.vocab_size}: a draft must share the "
                         "target's vocabulary")
    if spec.num_params > target.num_params:
        raise ValueError(f"draft model {spec.name} ({spec.num_params:,} parameters) is larger "
                         f"than the target {target.name} ({target.num_params:,}): use a smaller "
                         "draft")
    window = sliding_window(spec)
    if window is not None and max_model_len > window:
        raise ValueError(f"draft model {spec.name} attends over a sliding window of {window} "
                         f"tokens, below max_model_len {max_model_len}: use max_model_len <= {window}")
    return spec


def build_proposer(config: SpeculativeConfig, spec: ModelSpec | None,
                   make_runner: Callable[..., ModelRunner]) -> Proposer:
    """The proposer of `config`; `make_runner(spec, checkpoint=...)` builds the draft's runner
    with the target's device, dtype, block pools and seed (so a draft with the target's
    config and no checkpoint is the target itself)."""
    if config.method == "ngram":
        return NgramProposer()
    return DraftProposer(make_runner(spec, checkpoint=draft_checkpoint(config.draft_model)))

