"""KV-cache block managers: the one way the scheduler touches KV memory.

`PagedBlockManager` is the vLLM-style manager (paging, prefix caching, copy-on-write,
swap); `ContiguousBlockManager` is the reserve-up-front baseline it replaced. Both follow
the `BlockManager` protocol in `base`, so policies and executors never know which one
is behind it. Each registers itself by name (`registry`); every module of this package is
imported here, so a new manager is one new file. Pure standard library: no torch,
triton, simpy or numpy.
"""
from __future__ import annotations

from servelab.registry import import_submodules

from .base import AllocStatus, BlockManager, BlockManagerError, BlockUsage
from .paged import PagedBlockManager   # first: the default leads the list of names
from .contiguous import ContiguousBlockManager
from .registry import (block_manager_names, caches_prefixes, make_block_manager,
                       register_block_manager)

__all__ = ["AllocStatus", "BlockManager", "BlockManagerError", "BlockUsage",
           "ContiguousBlockManager", "PagedBlockManager", "block_manager_names", "caches_prefixes",
           "make_block_manager", "register_block_manager"]

import_submodules(__name__, __path__)
