"""Hot ops behind one interface: torch reference (any device) and CuPy kernels (CUDA)."""

from ringllm.pipeline.ops.interface import Ops
from ringllm.pipeline.ops.torch_ref import TorchOps


def get_ops(device: str) -> Ops:
    """The ops for a resolved device: CuPy kernels on cuda, torch reference on cpu."""
    if device == "cuda":
        from ringllm.cuda.ops import CudaOps

        return CudaOps()
    return TorchOps()


__all__ = ["Ops", "TorchOps", "get_ops"]
