"""shardio: feed deep-learning training from large checksummed shards at full storage speed.

``import shardio`` is light: torch, h5py and the reading stack load only when used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = [
    "DatasetReader",
    "LoaderOptions",
    "Manifest",
    "PackOptions",
    "ReadOptions",
    "ShardDataset",
    "ShardLoader",
    "Topology",
    "__version__",
    "describe",
    "errors",
    "index_tars",
    "merge",
    "open_dataset",
    "pack",
    "verify_dataset",
    "zero_copy_collate",
]

_LAZY = {
    "DatasetReader": ("shardio.reader", "DatasetReader"),
    "Manifest": ("shardio.manifest", "Manifest"),
    "PackOptions": ("shardio.config", "PackOptions"),
    "ReadOptions": ("shardio.config", "ReadOptions"),
    "LoaderOptions": ("shardio.config", "LoaderOptions"),
    "ShardDataset": ("shardio.dataset", "ShardDataset"),
    "ShardLoader": ("shardio.loader", "ShardLoader"),
    "Topology": ("shardio.topology", "Topology"),
    "describe": ("shardio.summary", "describe"),
    "errors": ("shardio.errors", None),
    "index_tars": ("shardio.indexer", "index_tars"),
    "merge": ("shardio.parts", "merge"),
    "open_dataset": ("shardio.reader", "open_dataset"),
    "pack": ("shardio.packer", "pack"),
    "verify_dataset": ("shardio.verify", "verify_dataset"),
    "zero_copy_collate": ("shardio.dataset", "zero_copy_collate"),
}


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'shardio' has no attribute {name!r}") from None
    mod = importlib.import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
