"""Frozen, validated configuration of the scheduler and the KV cache.

Each config is a small frozen dataclass checked in `__post_init__`; a bad value raises
ValueError naming the field and the allowed range. Configs never read the environment or
write files, and derived runtime values (e.g. how many blocks fit on a GPU) live
elsewhere, never written back here.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from servelab._validate import check_choice, check_float, check_int, check_name

STEP_COMPOSITIONS = ("decode_first", "prefill_first")
BATCHING_MODES = ("continuous", "static")


@dataclass(frozen=True)
class AdmissionConfig:
    """The admission stage before the policy (`servelab.policies.admission_control`);
    every rule is off by default."""

    tenant_queue_limit: int | None = None
    """Reject an arrival while this many requests of its tenant wait to start."""
    tenant_rate: float | None = None
    """Token bucket per tenant: admit its arrivals at this many requests/s on average."""
    tenant_burst: float = 10.0
    """The bucket's depth: arrivals a tenant may send at once after an idle spell."""
    shed_from_priority: int | None = None
    """Shed a request of this priority or a larger value (a lower tier) when its predicted
    wait exceeds its TTFT SLO; None: never shed."""
    shed_default_slo_ms: float = 10_000.0
    """The TTFT SLO shedding judges a request without one of its own by."""

    def __post_init__(self) -> None:
        o = "AdmissionConfig"
        if self.tenant_queue_limit is not None:
            check_int(o, "tenant_queue_limit", self.tenant_queue_limit, 0)
        if self.tenant_rate is not None:
            check_float(o, "tenant_rate", self.tenant_rate, 0.0, lo_open=True)
        check_float(o, "tenant_burst", self.tenant_burst, 1.0)
        if self.shed_from_priority is not None:
            check_int(o, "shed_from_priority", self.shed_from_priority)
        check_float(o, "shed_default_slo_ms", self.shed_default_slo_ms, 0.0, lo_open=True)

    @property
    def enabled(self) -> bool:
        return (self.tenant_queue_limit, self.tenant_rate, self.shed_from_priority) != (None,) * 3

    def to_dict(self) -> dict:
        return asdict(self)


SPECULATIVE_METHODS = ("draft", "ngram", "eagle", "mtp")
"""Proposers (`servelab.speculative`): a smaller draft model of the same vocabulary, an
n-gram lookup in the request's own tokens, an EAGLE head, or the model's own multi-token
prediction (MTP) layer."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`servelab.speculative`); off by default (method None)."""

    method: str | None = None
    num_speculative_tokens: int = 4
    """K: tokens proposed per step of a speculating sequence (vLLM's num_speculative_tokens)."""
    draft_model: str | None = None
    """The draft model (catalog name or config.json path) of method 'draft'."""
    acceptance: float = 0.8
    """Per-token acceptance probability of a proposed token (simulation; the real backend
    measures it)."""
    tenant_acceptance: tuple[tuple[str, float], ...] = ()
    """Per-tenant acceptance overriding `acceptance` ((tenant, rate), ...)."""
    max_batch: int | None = None
    """Speculate only in steps with at most this many decoding sequences (engines turn
    speculation off at large batch, where verify work crowds out other requests)."""

    def __post_init__(self) -> None:
        o = "SpeculativeConfig"
        if isinstance(self.tenant_acceptance, dict):   # from config.json
            object.__setattr__(self, "tenant_acceptance", tuple(sorted(self.tenant_acceptance.items())))
        if self.method is not None:
            check_choice(o, "method", self.method, SPECULATIVE_METHODS)
        check_int(o, "num_speculative_tokens", self.num_speculative_tokens, 1)
        check_float(o, "acceptance", self.acceptance, 0.0, 1.0)
        for tenant, rate in self.tenant_acceptance:
            check_float(o, f"tenant_acceptance[{tenant}]", rate, 0.0, 1.0)
        if self.max_batch is not None:
            check_int(o, "max_batch", self.max_batch, 1)
        if self.method == "draft" and not self.draft_model:
            raise ValueError(f"{o}: method 'draft' needs a draft_model")
        if self.method != "draft" and self.draft_model:
            raise ValueError(f"{o}: a draft_model is for method 'draft', not {self.method!r}")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    def acceptance_of(self, tenant: str) -> float:
        for name, rate in self.tenant_acceptance:
            if name == tenant:
                return rate
        return self.acceptance

    def to_dict(self) -> dict:
        out = asdict(self)
        out["tenant_acceptance"] = dict(self.tenant_acceptance)
        return out


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    """Most sequences in one step (vLLM v1 default 128)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: prefill chunk tokens + one per decoding sequence."""
    chunked_prefill: int | None = 512
    """Largest prefill chunk one sequence may compute in a step; None turns chunking off
    (then a prompt larger than the token budget can never run and is rejected)."""
    step_composition: str = "decode_first"
    """decode_first: running decodes first, then prefill chunks fill the budget (Sarathi
    stall-free); prefill_first: waiting prefills first, decodes only in steps without one."""
    preemption: str = "recompute"
    """A registered preemption strategy (servelab.policies.preemption: recompute, swap);
    the name is checked when a scheduler is built."""
    max_model_len: int = 8192
    waiting_queue_limit: int | None = None
    """Reject arrivals when this many requests already wait (the HTTP 429 analogue)."""
    batching: str = "continuous"
    """continuous (iteration-level) or static (a batch runs until all members finish)."""
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    """The admission stage before the policy (also read from its `to_dict` form)."""
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    """Speculative decoding (also read from its `to_dict` form); off by default."""

    def __post_init__(self) -> None:
        o = "SchedulerConfig"
        if isinstance(self.admission, dict):   # from config.json
            try:
                object.__setattr__(self, "admission", AdmissionConfig(**self.admission))
            except TypeError as exc:
                raise ValueError(f"{o}.admission: {exc}") from None
        if not isinstance(self.admission, AdmissionConfig):
            raise ValueError(f"{o}.admission must be an AdmissionConfig, got {self.admission!r}")
        if isinstance(self.speculative, dict):   # from config.json
            try:
                object.__setattr__(self, "speculative", SpeculativeConfig(**self.speculative))
            except TypeError as exc:
                raise ValueError(f"{o}.speculative: {exc}") from None
        if not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(f"{o}.speculative must be a SpeculativeConfig, got {self.speculative!r}")
        check_int(o, "max_num_seqs", self.max_num_seqs, 1)
        check_int(o, "max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.chunked_prefill is not None:
            check_int(o, "chunked_prefill", self.chunked_prefill, 1)
        check_choice(o, "step_composition", self.step_composition, STEP_COMPOSITIONS)
        check_name(o, "preemption", self.preemption)
        check_int(o, "max_model_len", self.max_model_len, 2)
        if self.waiting_queue_limit is not None:
            check_int(o, "waiting_queue_limit", self.waiting_queue_limit, 0)
        check_choice(o, "batching", self.batching, BATCHING_MODES)

    def to_dict(self) -> dict:
        """As a dict; without `admission` when no rule is on and without `speculative`
        when it is off (configs read as before)."""
        out = asdict(self)
        if not self.admission.enabled:
            del out["admission"]
        if self.speculative.enabled:
            out["speculative"] = self.speculative.to_dict()
        else:
            del out["speculative"]
        return out


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_gpu_blocks: int = 4096
    num_cpu_blocks: int = 0
    """Swap space in blocks; 0 means swap preemption always falls back to recompute."""
    watermark: float = 0.01
    """Fraction of GPU blocks kept free when admitting new sequences (vLLM v0: 1%)."""
    enable_prefix_caching: bool = False
    block_manager: str = "paged"
    """A registered block manager (servelab.memory.registry: paged, contiguous-max,
    contiguous-pow2, contiguous-oracle); the name is checked when one is built."""
    num_host_blocks: int = 0
    """Host-memory (CPU) tier of the prefix cache, in blocks: prefix blocks evicted from
    the GPU are kept there (LRU) and loaded back on a hit. Needs enable_prefix_caching;
    separate from the swap pool (num_cpu_blocks)."""

    def __post_init__(self) -> None:
        o = "CacheConfig"
        check_int(o, "block_size", self.block_size, 1, 1 << 16)
        check_int(o, "num_gpu_blocks", self.num_gpu_blocks, 1)
        check_int(o, "num_cpu_blocks", self.num_cpu_blocks, 0)
        check_float(o, "watermark", self.watermark, 0.0, 0.5)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"{o}.enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        check_name(o, "block_manager", self.block_manager)
        check_int(o, "num_host_blocks", self.num_host_blocks, 0)
        if self.num_host_blocks and not self.enable_prefix_caching:
            raise ValueError(f"{o}.num_host_blocks: a CPU tier holds prefix-cache blocks and "
                             "needs enable_prefix_caching")

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_gpu_blocks)

    def to_dict(self) -> dict:
        return asdict(self)
