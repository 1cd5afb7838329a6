"""The paged KV cache as tensors: a device pool, two host pools, and block moves between them.

The host pools are the CPU swap pool (preempted sequences' KV, `swap_out` / `swap_in`) and
the CPU tier of the prefix cache (prefix blocks evicted from the device, `offload` /
`load`). The block manager numbers their blocks separately, so they are separate tensors.
A disaggregated run (`backends/disaggregated.py`) keeps two caches of one layout (`like`)
and moves a prompt's blocks from one to the other (`copy_blocks_to`).

Every pool holds all layers in one tensor per K and V, shaped
`[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`, so `layer(i)` is a view and
a block move touches every layer with one gather and one scatter per pool (no Python loop
over layers x blocks). The block ids are the ones the block manager hands out; this class
only executes the moves the scheduler asked for.

Memory: 2 x num_layers x num_blocks x block_size x num_kv_heads x head_dim x dtype bytes per
pool. The host pools are pinned when the device is CUDA, so moves run at full PCIe speed.
A move goes TRANSFER_BYTES at a time, so its temporaries stay small however many blocks
a step moves.
"""
from __future__ import annotations

import torch

__all__ = ["KVCache", "TRANSFER_BYTES"]

TRANSFER_BYTES = 64 << 20
"""Most bytes of K (and as many of V) one block move gathers and stages at once."""


class KVCache:
    """Per-layer K/V cache tensors on `device` plus an optional CPU swap pool
    (`num_cpu_blocks`) and an optional CPU tier of the prefix cache (`num_host_blocks`).

    With `poison=True` every slot (device and host) starts as NaN: a kernel or model that
    reads a slot nobody wrote then produces NaN, which tests can see. Poisoning needs a
    floating dtype and costs one fill per pool at creation.
    """

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 num_cpu_blocks: int = 0, num_host_blocks: int = 0,
                 poison: bool = False) -> None:
        for name, value, low in (("num_layers", num_layers, 1), ("num_blocks", num_blocks, 1),
                                 ("block_size", block_size, 1), ("num_kv_heads", num_kv_heads, 1),
                                 ("head_dim", head_dim, 1), ("num_cpu_blocks", num_cpu_blocks, 0),
                                 ("num_host_blocks", num_host_blocks, 0)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"KVCache.{name} must be an int >= {low}, got {value!r}")
        if not dtype.is_floating_point:
            raise ValueError(f"KVCache dtype must be floating point, got {dtype}")
        self.device = torch.device(device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.num_host_blocks = num_host_blocks
        block = (block_size, num_kv_heads, head_dim)
        pin = self.device.type == "cuda"
        fill = float("nan") if poison else 0.0
        self.k = torch.full((num_layers, num_blocks, *block), fill, dtype=dtype, device=self.device)
        self.v = torch.full((num_layers, num_blocks, *block), fill, dtype=dtype, device=self.device)
        self.cpu_k = torch.full((num_layers, num_cpu_blocks, *block), fill, dtype=dtype,
                                pin_memory=pin)
        self.cpu_v = torch.full((num_layers, num_cpu_blocks, *block), fill, dtype=dtype,
                                pin_memory=pin)
        self.host_k = torch.full((num_layers, num_host_blocks, *block), fill, dtype=dtype,
                                 pin_memory=pin)
        self.host_v = torch.full((num_layers, num_host_blocks, *block), fill, dtype=dtype,
                                 pin_memory=pin)

    def like(self, num_blocks: int, num_cpu_blocks: int = 0, poison: bool = False) -> "KVCache":
        """A new, empty cache of this one's layout (layers, block shape, dtype, device) with
        `num_blocks` device blocks and `num_cpu_blocks` swap blocks, and no CPU tier."""
        _, _, block_size, num_kv_heads, head_dim = self.k.shape
        return KVCache(num_layers=self.num_layers, num_blocks=num_blocks, block_size=block_size,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=self.k.dtype,
                       device=self.device, num_cpu_blocks=num_cpu_blocks, poison=poison)

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (k_cache, v_cache) of one layer, each
        [num_blocks, block_size, num_kv_heads, head_dim]."""
        return self.k[index], self.v[index]

    @property
    def bytes_per_block(self) -> int:
        """Device bytes one block takes across all layers, K and V."""
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    def _indices(self, pairs: list[tuple[int, int]], what: str, src_pool: int,
                 dst_pool: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Checked (src, dst) index vectors; every destination distinct."""
        src = [int(p[0]) for p in pairs]
        dst = [int(p[1]) for p in pairs]
        for name, ids, bound in (("source", src, src_pool), ("destination", dst, dst_pool)):
            bad = [b for b in ids if not 0 <= b < bound]
            if bad:
                raise ValueError(f"{what}: {name} block(s) {bad[:5]} outside [0, {bound})")
        if len(set(dst)) != len(dst):
            raise ValueError(f"{what}: a destination block appears twice in {pairs}")
        return torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64)

    def _host_buffer(self, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        """Staging memory for one transfer: pinned when the device is CUDA (DMA at PCIe speed)."""
        return torch.empty(shape, dtype=self.k.dtype, pin_memory=self.device.type == "cuda")

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copies device blocks to swap-pool blocks, given (gpu_block, cpu_block) pairs."""
        self._to_host(pairs, "swap_out", self.cpu_k, self.cpu_v)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copies swap-pool blocks back to device blocks, given (cpu_block, gpu_block) pairs."""
        self._from_host(pairs, "swap_in", self.cpu_k, self.cpu_v)

    def offload(self, pairs: list[tuple[int, int]]) -> None:
        """Copies evicted prefix blocks to the CPU tier, given (gpu_block, host_block) pairs."""
        self._to_host(pairs, "offload", self.host_k, self.host_v)

    def load(self, pairs: list[tuple[int, int]]) -> None:
        """Copies CPU-tier prefix hits back to device blocks, given (host_block, gpu_block)
        pairs."""
        self._from_host(pairs, "load", self.host_k, self.host_v)

    def _chunks(self, src: torch.Tensor, dst: torch.Tensor):
        """(src, dst) index slices of at most TRANSFER_BYTES of K (or V) each: a long
        prompt can move thousands of blocks in one step, and the device gather and the
        pinned staging buffer hold one chunk, not all of them. (Source and destination
        are in different pools, so the chunks cannot see each other's writes.)"""
        per_block = self.k[:, :1].numel() * self.k.element_size()
        n = max(1, TRANSFER_BYTES // per_block)
        for start in range(0, len(src), n):
            yield src[start:start + n], dst[start:start + n]

    def _to_host(self, pairs: list[tuple[int, int]], what: str, host_k: torch.Tensor,
                 host_v: torch.Tensor) -> None:
        if not pairs:
            return
        src, dst = self._indices(pairs, what, self.num_blocks, host_k.shape[1])
        for src, dst in self._chunks(src.to(self.device), dst):
            for pool, host in ((self.k, host_k), (self.v, host_v)):
                gathered = pool.index_select(1, src)
                staged = self._host_buffer(gathered.shape)
                staged.copy_(gathered)
                host.index_copy_(1, dst, staged)

    def _from_host(self, pairs: list[tuple[int, int]], what: str, host_k: torch.Tensor,
                   host_v: torch.Tensor) -> None:
        if not pairs:
            return
        src, dst = self._indices(pairs, what, host_k.shape[1], self.num_blocks)
        for src, dst in self._chunks(src, dst.to(self.device)):
            for pool, host in ((self.k, host_k), (self.v, host_v)):
                staged = self._host_buffer((host.shape[0], len(src), *host.shape[2:]))
                torch.index_select(host, 1, src, out=staged)
                pool.index_copy_(1, dst, staged.to(self.device))

    def copy_blocks_to(self, other: "KVCache", pairs: list[tuple[int, int]]) -> int:
        """Copies device blocks of this cache into device blocks of `other`, given
        (src, dst) pairs, every layer's K and V; returns the bytes copied. `other` must
        have this cache's layout (`like`); on one CUDA device the copy stays on the device
        (a gather and a scatter per chunk of TRANSFER_BYTES), across devices it goes
        device to device. The copy is queued on the current stream, not waited for."""
        if not pairs:
            return 0
        if other.k.shape[0] != self.k.shape[0] or other.k.shape[2:] != self.k.shape[2:] \
                or other.k.dtype != self.k.dtype:
            raise ValueError(f"copy_blocks_to: caches differ in layout ({tuple(self.k.shape)} "
                             f"{self.k.dtype} -> {tuple(other.k.shape)} {other.k.dtype}): KV "
                             "moves block for block, without conversion")
        src, dst = self._indices(pairs, "copy_blocks_to", self.num_blocks, other.num_blocks)
        for src, dst in self._chunks(src.to(self.device), dst.to(other.device)):
            for pool, into in ((self.k, other.k), (self.v, other.v)):
                into.index_copy_(1, dst, pool.index_select(1, src).to(other.device))
        return len(pairs) * self.bytes_per_block

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: copies device block src to device block dst, given (src, dst) pairs.

        All sources are read before any destination is written, so a block may be both a
        source and (in another pair) a destination."""
        if not pairs:
            return
        src, dst = self._indices(pairs, "copy_blocks", self.num_blocks, self.num_blocks)
        src, dst = src.to(self.device), dst.to(self.device)
        for pool in (self.k, self.v):
            pool.index_copy_(1, dst, pool.index_select(1, src))
