"""prepfuse: fused attention-input preparation for LLM inference engines on PyTorch.

``import prepfuse`` registers the ``torch.ops.prepfuse`` ops. It changes no global
compiler setting.
"""

from prepfuse import ops
from prepfuse import backend  # registers torch.compile(backend="prepfuse")

__version__ = "0.1.0"
__all__ = ["ops", "__version__"]
