"""kvevict: KV-cache eviction building blocks on PyTorch and NumPy tensors (docs/python.md)."""
from ._core import *  # noqa: F401,F403
from ._core import Error, has_cuda  # noqa: F401
from . import presses  # noqa: F401
