"""Hot ops behind one interface: torch reference (any device), C kernels (CPU), CuPy kernels (CUDA)."""

import logging

from ringllm.pipeline.ops.interface import Ops
from ringllm.pipeline.ops.torch_ref import TorchOps

logger = logging.getLogger(__name__)


def get_ops(device: str) -> Ops:
    """The ops for a resolved device: CuPy kernels on cuda; on cpu the C kernels
    (`CpuOps`, or `TorchOps` when RINGLLM_CPU_KERNELS=torch)."""
    if device == "cuda":
        from ringllm.cuda.ops import CudaOps

        return CudaOps()
    from ringllm.pipeline.ops.cpu import CpuOps, default_kernel_set

    kernel_set = default_kernel_set()
    if kernel_set is None:
        return TorchOps()
    return CpuOps(kernel_set)


__all__ = ["Ops", "TorchOps", "get_ops"]
