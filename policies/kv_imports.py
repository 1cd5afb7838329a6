"""Waiting requests whose KV cache was computed elsewhere: disaggregated imports.

Under disaggregated prefill/decode (simulator/disaggregation.py, backends/disaggregated.py)
a decode engine receives a request whose prompt a prefill engine computed: its importer
(`land`, simulator/kv_handoff.py, in both executors) allocates the request's blocks in this
engine's block manager, sets the computed tokens, and adds it to the scheduler, where it
waits like any arrival but needs no free memory (`KVAdmission`, policies/admission.py). The
scheduler notes such requests (`Scheduler._imports`) at `add_request`.

One case needs their own rule: when nothing runs or is swapped out and the policy's head
waits for memory that only waiting imports hold, the head would wait forever. The imports
then start first (`_start_imports`), in request-id order, and free their blocks when they
end.

The method here is part of `Scheduler` (policies/scheduler.py), kept apart because it is
one idea of its own.
"""
from __future__ import annotations

__all__ = ["KVImports"]


class KVImports:
    """The import part of `Scheduler` (a mixin: it uses the scheduler's `policy`, `_kv`,
    `_requests`, `_imports` and `_start`)."""

    def _start_imports(self, now, step, seats: int) -> None:
        """Start the waiting imports while they fit in `seats` and the step budget: they
        hold their blocks already, so allocating them is OK by construction."""
        for rid in sorted(self._imports):
            imported = self._requests[rid]
            live = sum(1 for s in imported.seqs if not s.finished)
            if live > seats or step.tokens <= 0 or step.seqs <= 0 \
                    or step.plan(imported, allocated=False) is None:
                return
            self._kv.allocate(imported)
            self.policy.remove(imported)
            self._start(imported, now, step)
            seats -= live
