"""Fixtures for the kernel tests: CudaOps on the CPU emulator, in both thread orders.

Every kernel test runs once with the threads of each block in forward order and once
reversed, so a missing barrier changes the answer in one of the two runs. The ops
objects are session-scoped: each kernel family is compiled (or fetched from the on-disk
cache) once per order and reused by every test.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from ringllm.cuda.emulator import THREAD_ORDERS
from ringllm.cuda.ops import CudaOps
from ringllm.pipeline.ops import TorchOps

# Documented tolerances against TorchOps. float32: the kernels compute in float32 like the
# reference, differing only in summation order. 16-bit: both round once from float32, so
# a result may differ by one unit in the last place (fp16: 2**-10, bf16: 2**-7 relative).
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}


requires_gxx = pytest.mark.skipif(
    shutil.which("g++") is None, reason="needs g++ for the CUDA emulator"
)


def pytest_collection_modifyitems(config, items):
    """Every test here but the GPU and compile-check ones runs kernels through g++."""
    for item in items:
        path = str(item.fspath)
        if "tests/cuda/" in path and not path.endswith(
            ("test_cuda_gpu.py", "test_cuda_compile.py")
        ):
            item.add_marker(requires_gxx)


@pytest.fixture(scope="session", params=THREAD_ORDERS)
def emulated_ops(request) -> CudaOps:
    return CudaOps(backend="emulator", thread_order=request.param)


@pytest.fixture(scope="session")
def reference_ops() -> TorchOps:
    return TorchOps()


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **TOLERANCES[expected.dtype])


@pytest.fixture(scope="session")
def assert_close():
    """Compares a kernel's result with TorchOps' at the documented tolerance of its dtype."""
    return _assert_close
