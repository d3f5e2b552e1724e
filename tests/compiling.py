"""Turns torch.compile back on for the tests of the compiled path (conftest.py turns it off for the others)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch._dynamo


@contextmanager
def compile_enabled() -> Iterator[None]:
    """torch.compile on in this process and in the processes it spawns meanwhile."""
    saved = os.environ.pop("TORCH_COMPILE_DISABLE", None)
    try:
        with torch._dynamo.config.patch(disable=False):
            yield
    finally:
        if saved is not None:
            os.environ["TORCH_COMPILE_DISABLE"] = saved
