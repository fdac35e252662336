"""Importing FBGEMM and TorchRec without changing the caller's logging.

fbgemm_gpu logs with `logging.info` while it is imported, which runs `logging.basicConfig()` and gives the root
logger a stderr handler when it has none. A notebook or training script that imports embshard and later calls
`logging.basicConfig(level=..., format=...)` then got nothing from it (basicConfig does nothing once the root has
a handler). `root_logging_kept` removes the handlers such an import adds.
"""
from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def root_logging_kept():
    """The root logger's handlers as they were before the block (the ones the block added removed)."""
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        yield
    finally:
        for handler in [h for h in root.handlers if h not in before]:
            root.removeHandler(handler)
