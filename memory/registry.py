"""The block managers a `CacheConfig.block_manager` can name.

Each manager's file registers a factory, `factory(cache_config, max_model_len)`, under its
name; `make_block_manager` builds the one a config names. A new manager is one file with
its class and a `register_block_manager` call (docs/extending.md).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from servelab.registry import Registry

from .base import BlockManager

if TYPE_CHECKING:
    from servelab.config import CacheConfig

BlockManagerFactory = Callable[["CacheConfig", int], BlockManager]
BLOCK_MANAGERS: Registry[BlockManagerFactory] = Registry("block manager")


_NO_PREFIX_CACHE: set[str] = set()


def register_block_manager(name: str, factory: BlockManagerFactory, *,
                           caches_prefixes: bool = True) -> BlockManagerFactory:
    """Add a block manager under `name`; a duplicate name is an error. `caches_prefixes`
    False: the manager keeps no prefix cache (a `CacheConfig` asking for one builds it all
    the same, with no hits: the comparison the contiguous baselines make), so a command
    line that asks for prefix caching or a CPU tier of it with this manager is refused."""
    if not caches_prefixes:
        _NO_PREFIX_CACHE.add(name)
    return BLOCK_MANAGERS.add(name, factory)


def caches_prefixes(name: str) -> bool:
    """Whether the block manager registered as `name` keeps a prefix cache."""
    return name not in _NO_PREFIX_CACHE


def block_manager_names() -> list[str]:
    return BLOCK_MANAGERS.names()


def make_block_manager(cache: CacheConfig, max_model_len: int) -> BlockManager:
    """The block manager `cache.block_manager` names, sized by the config
    (`max_model_len` sizes reservation-based managers)."""
    return BLOCK_MANAGERS.get(cache.block_manager)(cache, max_model_len)
