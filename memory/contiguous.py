"""Contiguous-reservation KV-cache managers: the baselines from before PagedAttention.

Each sequence reserves ONE contiguous run of blocks at `allocate`, sized by `mode`:

- ``max``: `max_model_len` tokens, whatever the request (the classic worst case);
- ``pow2``: the next power of two of prompt + max tokens (`max_total_tokens`), capped
  at `max_model_len` (a bucketing allocator);
- ``oracle``: the true final length (`expected_total_tokens`): no reservation waste,
  but external fragmentation remains.

A reservation is never smaller than the tokens it must hold now. Runs are placed
first-fit over the block address space, so external fragmentation is real: enough
free blocks in total but no run long enough gives LATER. Appends inside the
reservation cost nothing; growing past it (a max_tokens underestimate) extends the run
in place when the blocks right after it are free, and is otherwise impossible
(`can_append_slots` says False).

`fork` shares the parent's reservation, and the first append by any sharer copies the
whole run to a new reservation (the returned pairs are the copies): the eager copy of a
pre-paging system, done at the moment the sample first writes. No prefix caching:
queries and hits stay 0. Swapping moves whole reservations to first-fit runs of the CPU
pool; the copy pairs cover the blocks holding tokens.

Costs: first-fit and release are O(number of free extents), appends within the
reservation O(1).
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import Hashable, Iterable, Literal, Sequence

from .base import (AllocStatus, BlockManager, BlockManagerError, BlockUsage, check_count,
                   check_pool, check_size, unique_ids, invariant)
from .registry import register_block_manager

_OK, _LATER, _NEVER = AllocStatus.OK, AllocStatus.LATER, AllocStatus.NEVER
MODES = ("max", "pow2", "oracle")
_Action = Literal["fits", "grow", "copy"]


class Extents:
    """Free runs of the address space [0, size): sorted by start, never adjacent
    (coalesced on release). Two parallel lists keep first-fit a plain scan."""

    __slots__ = ("size", "starts", "lengths", "num_free")

    def __init__(self, size: int) -> None:
        self.size = size
        self.starts: list[int] = [0] if size else []
        self.lengths: list[int] = [size] if size else []
        self.num_free = size

    def first_fit(self, n: int) -> int | None:
        """Index of the lowest extent with at least n blocks. O(extents)."""
        for i, length in enumerate(self.lengths):
            if length >= n:
                return i
        return None

    def largest(self) -> int:
        return max(self.lengths, default=0)

    def fits_all(self, sizes: Sequence[int]) -> bool:
        """Would first-fit place every run of `sizes`, in order? Changes nothing."""
        lengths = list(self.lengths)
        for n in sizes:
            i = next((i for i, length in enumerate(lengths) if length >= n), None)
            if i is None:
                return False
            lengths[i] -= n
        return True

    def after(self, end: int) -> int | None:
        """Index of the extent starting exactly at `end`, if any. O(log extents)."""
        i = bisect.bisect_left(self.starts, end)
        return i if i < len(self.starts) and self.starts[i] == end else None

    def take(self, i: int, n: int) -> int:
        """The first n blocks of extent i; returns their start."""
        start = self.starts[i]
        if self.lengths[i] == n:
            del self.starts[i], self.lengths[i]
        else:
            self.starts[i] += n
            self.lengths[i] -= n
        self.num_free -= n
        return start

    def release(self, start: int, n: int) -> None:
        """Give back [start, start + n), merging with the neighbours it touches."""
        starts, lengths = self.starts, self.lengths
        i = bisect.bisect_left(starts, start)
        joins_left = i > 0 and starts[i - 1] + lengths[i - 1] == start
        joins_right = i < len(starts) and start + n == starts[i]
        if joins_left and joins_right:
            lengths[i - 1] += n + lengths[i]
            del starts[i], lengths[i]
        elif joins_left:
            lengths[i - 1] += n
        elif joins_right:
            starts[i] = start
            lengths[i] += n
        else:
            starts.insert(i, start)
            lengths.insert(i, n)
        self.num_free += n

    def check(self, name: str) -> None:
        runs = list(zip(self.starts, self.lengths))
        for (s0, n0), (s1, _) in zip(runs, runs[1:]):
            invariant(s0 + n0 < s1, f"{name} free extents overlap or touch: {runs}")
        invariant(all(n > 0 for _, n in runs) and all(0 <= s and s + n <= self.size for s, n in runs),
                  f"{name} free extents out of range: {runs}")
        invariant(sum(self.lengths) == self.num_free, f"{name} free count is off")


@dataclass(slots=True, eq=False)
class _Reservation:
    start: int
    num_blocks: int
    refcount: int
    on_gpu: bool = True


@dataclass(slots=True, eq=False)
class _Seq:
    res: _Reservation
    num_tokens: int


class ContiguousBlockManager(BlockManager):
    """One contiguous, up-front reservation per sequence (see the module docstring).

    `num_used_blocks` counts reserved blocks (no one else can use them);
    `usage().reserved_unused_slots` is the part of them holding no token yet.
    """

    __slots__ = ("block_size", "num_gpu_blocks", "num_cpu_blocks", "mode", "max_model_len",
                 "watermark_blocks", "_seqs", "_gpu", "_cpu", "_slots_used")

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0, *,
                 mode: str = "max", max_model_len: int, watermark_blocks: int = 0) -> None:
        owner = type(self).__name__
        check_pool(owner, block_size, num_gpu_blocks, num_cpu_blocks, watermark_blocks)
        self.max_model_len = check_size(owner, "max_model_len", max_model_len, 1)
        self.block_size, self.num_gpu_blocks, self.num_cpu_blocks = block_size, num_gpu_blocks, num_cpu_blocks
        self.watermark_blocks = watermark_blocks
        if mode not in MODES:
            raise ValueError(f"{owner}: mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self._seqs: dict[Hashable, _Seq] = {}
        self._gpu = Extents(num_gpu_blocks)
        self._cpu = Extents(num_cpu_blocks)
        self._slots_used = 0
        """Tokens in GPU reservations, each reservation counted once."""

    @classmethod
    def from_config(cls, cache, max_model_len: int, *, mode: str) -> ContiguousBlockManager:
        """The manager a `CacheConfig` describes. No prefix cache: enable_prefix_caching
        leaves it unchanged (its prefix hits stay 0, which is the comparison made)."""
        return cls(cache.block_size, cache.num_gpu_blocks, cache.num_cpu_blocks, mode=mode,
                   max_model_len=max_model_len, watermark_blocks=cache.watermark_blocks)

    # ------------------------------------------------------------------ admission
    def reservation_blocks(self, num_tokens: int, max_total_tokens: int | None = None,
                           expected_total_tokens: int | None = None, *,
                           op: str = "reservation_blocks") -> int:
        """Blocks a new sequence of `num_tokens` tokens reserves in this mode."""
        check_count(op, "num_tokens", num_tokens, 1)
        if self.mode == "max":
            tokens = self.max_model_len
        elif self.mode == "pow2":
            if max_total_tokens is None:
                raise BlockManagerError(f"{op}: mode 'pow2' needs max_total_tokens")
            check_count(op, "max_total_tokens", max_total_tokens, 1)
            tokens = min(1 << (max_total_tokens - 1).bit_length(), self.max_model_len)
        else:
            if expected_total_tokens is None:
                raise BlockManagerError(f"{op}: mode 'oracle' needs expected_total_tokens")
            check_count(op, "expected_total_tokens", expected_total_tokens, 1)
            tokens = expected_total_tokens
        return -(-max(tokens, num_tokens) // self.block_size)

    def can_allocate(self, num_tokens: int, block_contents: Sequence[Hashable] = (), *,
                     max_total_tokens: int | None = None,
                     expected_total_tokens: int | None = None) -> AllocStatus:
        """O(free extents)."""
        n = self.reservation_blocks(num_tokens, max_total_tokens, expected_total_tokens,
                                    op="can_allocate")
        return self._placement(n)[0]

    def allocate(self, seq_id: Hashable, num_tokens: int,
                 block_contents: Sequence[Hashable] = (), *,
                 max_total_tokens: int | None = None,
                 expected_total_tokens: int | None = None) -> int:
        if seq_id in self._seqs:
            raise BlockManagerError(f"allocate: sequence {seq_id!r} already has blocks")
        n = self.reservation_blocks(num_tokens, max_total_tokens, expected_total_tokens,
                                    op="allocate")
        status, extent = self._placement(n)
        if status is not _OK:
            raise BlockManagerError(
                f"allocate: no room for sequence {seq_id!r} ({status.value}): reserves {n} "
                f"blocks, largest free run {self._gpu.largest()}, {self._gpu.num_free} free, "
                f"watermark {self.watermark_blocks}")
        start = self._gpu.take(extent, n)
        self._seqs[seq_id] = _Seq(_Reservation(start, n, 1), num_tokens)
        self._slots_used += num_tokens
        return 0

    def _placement(self, num_blocks: int) -> tuple[AllocStatus, int | None]:
        """Admission verdict and the first-fit extent index when OK."""
        if num_blocks > self.num_gpu_blocks - self.watermark_blocks:
            return _NEVER, None
        if self._gpu.num_free - num_blocks < self.watermark_blocks:
            return _LATER, None
        extent = self._gpu.first_fit(num_blocks)
        return (_LATER, None) if extent is None else (_OK, extent)

    def mark_computed(self, seq_id: Hashable, num_computed_tokens: int) -> None:
        """No prefix cache: only checks its arguments."""
        seq = self._gpu_seq("mark_computed", seq_id)
        check_count("mark_computed", "num_computed_tokens", num_computed_tokens, 0)
        if num_computed_tokens > seq.num_tokens:
            raise BlockManagerError(f"mark_computed: sequence {seq_id!r} has {seq.num_tokens} "
                                    f"tokens, not {num_computed_tokens}")

    # ------------------------------------------------------------------ growth
    def can_append_slots(self, seq_id: Hashable, num_new_tokens: int) -> bool:
        """O(1) inside the reservation, O(log extents) to grow, O(extents) to copy."""
        seq = self._gpu_seq("can_append_slots", seq_id)
        check_count("can_append_slots", "num_new_tokens", num_new_tokens, 0)
        return self._append_plan(seq, num_new_tokens) is not None

    def append_slots(self, seq_id: Hashable, num_new_tokens: int) -> list[tuple[int, int]]:
        seq = self._gpu_seq("append_slots", seq_id)
        check_count("append_slots", "num_new_tokens", num_new_tokens, 0)
        plan = self._append_plan(seq, num_new_tokens)
        if plan is None:
            raise BlockManagerError(f"append_slots: no room for {num_new_tokens} more tokens of "
                                    f"sequence {seq_id!r} (reservation of {seq.res.num_blocks} "
                                    "blocks cannot grow in place)")
        action, extent, n = plan
        res = seq.res
        copies: list[tuple[int, int]] = []
        if action == "copy":
            start = self._gpu.take(extent, n)
            used = -(-seq.num_tokens // self.block_size)
            copies = [(res.start + i, start + i) for i in range(used)]
            res.refcount -= 1
            seq.res = _Reservation(start, n, 1)
            self._slots_used += seq.num_tokens
        elif action == "grow":
            self._gpu.take(extent, n)
            res.num_blocks += n
        seq.num_tokens += num_new_tokens
        self._slots_used += num_new_tokens
        return copies

    def max_uniform_growth(self, seq_ids: Sequence[Hashable], limit: int) -> int:
        """Exact, O(n log extents): 0 if any reservation is shared (its next token copies
        the run); otherwise the smallest room over the sequences, a run's room being its
        free slots plus the free extent right after it (each extent follows at most one
        run, so the sequences never compete for growth)."""
        check_count("max_uniform_growth", "limit", limit, 0)
        k = limit
        for seq_id in unique_ids("max_uniform_growth", seq_ids):
            seq = self._gpu_seq("max_uniform_growth", seq_id)
            res = seq.res
            if res.refcount > 1:
                return 0
            blocks = res.num_blocks
            extent = self._gpu.after(res.start + blocks)
            if extent is not None:
                blocks += self._gpu.lengths[extent]
            k = min(k, blocks * self.block_size - seq.num_tokens)
        return k

    def _append_plan(self, seq: _Seq, k: int) -> tuple[_Action, int | None, int] | None:
        """How k more tokens fit: (action, extent index, blocks to take from it), or
        None if they cannot. A shared run is copied whole to a first-fit extent; an
        own run grows into the free extent right after it."""
        res = seq.res
        blocks = -(-(seq.num_tokens + k) // self.block_size)
        if res.refcount > 1 and k:
            n = max(res.num_blocks, blocks)
            extent = self._gpu.first_fit(n)
            return None if extent is None else ("copy", extent, n)
        if blocks <= res.num_blocks:
            return "fits", None, 0
        extent = self._gpu.after(res.start + res.num_blocks)
        extra = blocks - res.num_blocks
        if extent is None or self._gpu.lengths[extent] < extra:
            return None
        return "grow", extent, extra

    def fork(self, parent_seq_id: Hashable, child_seq_id: Hashable) -> None:
        """O(1): the child shares the reservation until one of them appends."""
        parent = self._gpu_seq("fork", parent_seq_id)
        if child_seq_id in self._seqs:
            raise BlockManagerError(f"fork: child sequence {child_seq_id!r} already has blocks")
        parent.res.refcount += 1
        self._seqs[child_seq_id] = _Seq(parent.res, parent.num_tokens)

    def free(self, seq_id: Hashable) -> None:
        """O(free extents)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise BlockManagerError(f"free: unknown sequence {seq_id!r} "
                                    "(never allocated, or already freed)")
        del self._seqs[seq_id]
        res = seq.res
        res.refcount -= 1
        if not res.refcount:
            if res.on_gpu:
                self._gpu.release(res.start, res.num_blocks)
                self._slots_used -= seq.num_tokens
            else:
                self._cpu.release(res.start, res.num_blocks)

    # ------------------------------------------------------------------ swapping
    def can_swap_out(self, seq_ids: Iterable[Hashable]) -> bool:
        moving = self._group_reservations("can_swap_out", seq_ids, on_gpu=True)
        return self._cpu.fits_all([r.num_blocks for r in moving])

    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        moving = self._group_reservations("swap_out", seq_ids, on_gpu=True)
        if not self._cpu.fits_all([r.num_blocks for r in moving]):
            raise BlockManagerError(
                f"swap_out: no CPU room for runs of {[r.num_blocks for r in moving]} blocks "
                f"({self._cpu.num_free} free, largest run {self._cpu.largest()})")
        return self._move(moving, self._gpu, self._cpu, to_gpu=False)

    def can_swap_in(self, seq_ids: Iterable[Hashable]) -> AllocStatus:
        moving = self._group_reservations("can_swap_in", seq_ids, on_gpu=False)
        return self._swap_in_status(moving)

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[tuple[int, int]]:
        moving = self._group_reservations("swap_in", seq_ids, on_gpu=False)
        status = self._swap_in_status(moving)
        if status is not _OK:
            raise BlockManagerError(
                f"swap_in: no GPU room ({status.value}) for runs of "
                f"{[r.num_blocks for r in moving]} blocks ({self._gpu.num_free} free, "
                f"largest run {self._gpu.largest()}, watermark {self.watermark_blocks})")
        return self._move(moving, self._cpu, self._gpu, to_gpu=True)

    def _swap_in_status(self, moving: dict[_Reservation, tuple[list[_Seq], int]]) -> AllocStatus:
        """As for admission; the watermark is waived when nothing else holds GPU blocks."""
        sizes = [r.num_blocks for r in moving]
        total = sum(sizes)
        if total > self.num_gpu_blocks:
            return _NEVER
        if not self._gpu.fits_all(sizes):
            return _LATER
        if self._gpu.num_free - total >= self.watermark_blocks or self.num_used_blocks == 0:
            return _OK
        return _LATER

    def _group_reservations(self, op: str, seq_ids: Iterable[Hashable], *,
                            on_gpu: bool) -> dict[_Reservation, tuple[list[_Seq], int]]:
        """Distinct reservations of the group, first seen first -> (its sequences in
        the group, tokens they hold)."""
        out: dict[_Reservation, tuple[list[_Seq], int]] = {}
        for seq_id in unique_ids(op, seq_ids):
            seq = self._seqs.get(seq_id)
            if seq is None:
                raise BlockManagerError(f"{op}: unknown sequence {seq_id!r}")
            if seq.res.on_gpu != on_gpu:
                where = "swapped out" if on_gpu else "not swapped out"
                raise BlockManagerError(f"{op}: sequence {seq_id!r} is {where}")
            out.setdefault(seq.res, ([], seq.num_tokens))[0].append(seq)
        return out

    def _move(self, moving: dict[_Reservation, tuple[list[_Seq], int]], src_pool: Extents,
              dst_pool: Extents, *, to_gpu: bool) -> list[tuple[int, int]]:
        """Give each reservation a first-fit run in `dst_pool` and point the group's
        sequences at it; a reservation also held outside the group stays for the others."""
        pairs: list[tuple[int, int]] = []
        for res, (seqs, num_tokens) in moving.items():
            start = dst_pool.take(dst_pool.first_fit(res.num_blocks), res.num_blocks)
            pairs.extend((res.start + i, start + i)
                         for i in range(-(-num_tokens // self.block_size)))
            res.refcount -= len(seqs)
            if not res.refcount:
                src_pool.release(res.start, res.num_blocks)
            moved = _Reservation(start, res.num_blocks, len(seqs), to_gpu)
            for seq in seqs:
                seq.res = moved
            if to_gpu:
                self._slots_used += num_tokens
            elif not res.refcount:
                self._slots_used -= num_tokens
        return pairs

    # ------------------------------------------------------------------ queries
    def block_table(self, seq_id: Hashable) -> list[int]:
        """The reserved blocks that hold tokens (the rest of the run is not shown)."""
        seq = self._seq("block_table", seq_id)
        start = seq.res.start
        return list(range(start, start + -(-seq.num_tokens // self.block_size)))

    def has_seq(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def is_swapped(self, seq_id: Hashable) -> bool:
        return not self._seq("is_swapped", seq_id).res.on_gpu

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._seq("num_tokens", seq_id).num_tokens

    def reserved_blocks(self, seq_id: Hashable) -> int:
        """Length of the sequence's reserved run."""
        return self._seq("reserved_blocks", seq_id).res.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._gpu.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_gpu_blocks - self._gpu.num_free

    def usage(self) -> BlockUsage:
        used = self.num_used_blocks
        allocated = used * self.block_size
        return BlockUsage(
            num_total_blocks=self.num_gpu_blocks, num_used_blocks=used,
            num_free_blocks=self._gpu.num_free, num_cached_blocks=0,
            token_slots_used=self._slots_used, token_slots_allocated=allocated,
            reserved_unused_slots=allocated - self._slots_used,
            num_cpu_total_blocks=self.num_cpu_blocks,
            num_cpu_used_blocks=self.num_cpu_blocks - self._cpu.num_free,
            prefix_queries=0, prefix_hits=0)

    # ------------------------------------------------------------------ internals
    def _seq(self, op: str, seq_id: Hashable) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise BlockManagerError(f"{op}: unknown sequence {seq_id!r}")
        return seq

    def _gpu_seq(self, op: str, seq_id: Hashable) -> _Seq:
        seq = self._seq(op, seq_id)
        if not seq.res.on_gpu:
            raise BlockManagerError(f"{op}: sequence {seq_id!r} is swapped out")
        return seq

    def check_invariants(self) -> None:
        holders: dict[_Reservation, list[_Seq]] = {}
        for seq in self._seqs.values():
            holders.setdefault(seq.res, []).append(seq)
        slots = 0
        for pool, extents, on_gpu in (("GPU", self._gpu, True), ("CPU", self._cpu, False)):
            extents.check(pool)
            runs = sorted((r.start, r.num_blocks) for r in holders if r.on_gpu == on_gpu)
            runs += list(zip(extents.starts, extents.lengths))
            runs.sort()
            invariant(sum(n for _, n in runs) == extents.size,
                      f"{pool}: reserved + free blocks != {extents.size}")
            for (s0, n0), (s1, _) in zip(runs, runs[1:]):
                invariant(s0 + n0 <= s1, f"{pool}: reservations or free runs overlap at block {s1}")
        for res, seqs in holders.items():
            invariant(res.refcount == len(seqs),
                      f"reservation at {res.start} has refcount {res.refcount}, {len(seqs)} holders")
            invariant(len({s.num_tokens for s in seqs}) == 1,
                      f"sharers of the reservation at {res.start} disagree on their length")
            invariant(all(1 <= s.num_tokens <= res.num_blocks * self.block_size for s in seqs),
                      f"a sequence outgrew its reservation at {res.start}")
            if res.on_gpu:
                slots += seqs[0].num_tokens
        invariant(slots == self._slots_used, f"slot count {self._slots_used} != {slots}")


for _mode in MODES:
    register_block_manager(f"contiguous-{_mode}",
                           functools.partial(ContiguousBlockManager.from_config, mode=_mode),
                           caches_prefixes=False)
del _mode
