"""kvevict: KV-cache eviction building blocks on PyTorch and NumPy tensors (docs/python.md)."""
import contextlib

from ._core import *  # noqa: F401,F403
from ._core import Error, has_cuda, host_isa_limit, set_host_isa_limit  # noqa: F401
from . import presses  # noqa: F401


@contextlib.contextmanager
def host_isa_limit_guard(limit):
    """`with kvevict.host_isa_limit_guard("avx2"):` caps the host kernel copies inside the block and puts the
    previous limit back after it, also when it raises (C++'s kvevict::host_isa_limit_guard)."""
    previous = host_isa_limit()
    set_host_isa_limit(limit)  # (a bad limit raises before anything changes)
    try:
        yield
    finally:
        set_host_isa_limit(previous)
