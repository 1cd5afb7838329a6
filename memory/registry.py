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


def register_block_manager(name: str, factory: BlockManagerFactory) -> BlockManagerFactory:
    """Add a block manager under `name`; a duplicate name is an error."""
    return BLOCK_MANAGERS.add(name, factory)


def block_manager_names() -> list[str]:
    return BLOCK_MANAGERS.names()


def make_block_manager(cache: CacheConfig, max_model_len: int) -> BlockManager:
    """The block manager `cache.block_manager` names, sized by the config
    (`max_model_len` sizes reservation-based managers)."""
    return BLOCK_MANAGERS.get(cache.block_manager)(cache, max_model_len)
