"""What the property suites draw: every registered policy, with options that exercise its
guards, and the admission stage's rules.

A policy missing from OPTIONS is drawn with its defaults; a test
(tests/test_policy_traits.py) holds every policy that declares flags to an entry here, so
a new policy is drawn, with its options, as soon as it registers.
"""
from __future__ import annotations

from hypothesis import strategies as st

from servelab.config import AdmissionConfig
from servelab.policies import policy_names

OPTIONS = {
    "priority": st.fixed_dictionaries({"preemptive": st.booleans(),
                                       "aging_rate": st.sampled_from([0.0, 1.0, 2.0])}),
    "sjf": st.fixed_dictionaries({"predictor": st.sampled_from(["oracle", "noisy", "prompt"]),
                                  "max_wait_s": st.sampled_from([None, 0.05, 1.0])}),
    "lpm": st.fixed_dictionaries({"max_wait_s": st.sampled_from([None, 0.05, 1.0]),
                                  "max_queue": st.sampled_from([2, 128])}),
    "fair": st.fixed_dictionaries({"weights": st.sampled_from([{}, {"a": 2.0, "b": 0.5}])}),
    "edf": st.fixed_dictionaries({"default_slo_ms": st.sampled_from([10_000.0, 30.0])}),
    "lsf": st.fixed_dictionaries({"default_slo_ms": st.sampled_from([10_000.0, 30.0]),
                                  "default_tpot_slo_ms": st.sampled_from([200.0, 5.0]),
                                  "prefill_tokens_per_s": st.sampled_from([100.0, 1e4])}),
    "mlfq": st.fixed_dictionaries({
        "quantum_tokens": st.sampled_from([1, 2, 8]),
        "quantum_ratio": st.sampled_from([1.0, 1.5, 2.0]),
        "num_levels": st.sampled_from([1, 2, 4]),
        "prefill_tokens_per_output_token": st.sampled_from([1.0, 16.0]),
        "max_wait_s": st.sampled_from([None, 0.01, 0.05, 1.0]),
        "preemptive": st.booleans()}),
}


@st.composite
def policies(draw) -> tuple[str, dict]:
    """(a registered policy, its options)."""
    name = draw(st.sampled_from(policy_names()))
    return name, draw(OPTIONS.get(name, st.just({})))


def admission_configs() -> st.SearchStrategy[AdmissionConfig]:
    """Mostly no rule; otherwise any mix of them, tight enough to refuse some requests."""
    some = st.builds(
        AdmissionConfig,
        tenant_queue_limit=st.sampled_from([None, 0, 1, 3]),
        tenant_rate=st.sampled_from([None, 5.0, 100.0]),
        tenant_burst=st.sampled_from([1.0, 2.0]),
        shed_from_priority=st.sampled_from([None, 0, 2]),
        shed_default_slo_ms=st.sampled_from([20.0, 10_000.0]))
    return st.one_of(st.just(AdmissionConfig()), st.just(AdmissionConfig()), some)
