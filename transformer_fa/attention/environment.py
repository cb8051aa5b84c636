"""Environment variables read on every call (a change in ``os.environ`` takes effect at once),
read cheaply: ``os.environ.get`` encodes the name on every call (about a microsecond a
variable, on every attention call), while os.environ's own dict, keyed by the encoded names,
answers at once."""
from __future__ import annotations

import os
from typing import Callable, Tuple

import torch

_DATA = getattr(os.environ, "_data", None)


def reader(names: Tuple[str, ...]) -> Callable[[], tuple]:
    """A function that returns the raw values of ``names`` now: None where unset, else str
    or bytes (os.environ's own encoding), so compare them with ``in ("0", b"0")``-style
    tests or use them as keys only. Under torch.compile it reads through os.environ.get,
    which the tracer knows."""
    keys = tuple(map(os.environ.encodekey, names)) if _DATA is not None else None

    def read() -> tuple:
        if keys is not None and not torch.compiler.is_compiling():
            return tuple(map(_DATA.get, keys))
        return tuple(map(os.environ.get, names))

    return read
