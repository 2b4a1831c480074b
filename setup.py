"""Only the C extensions live here; everything else is in setup.cfg."""

from setuptools import Extension, setup

CPU_OPS = "pipeline/ops/csrc/"

setup(
    ext_modules=[
        Extension(
            "ringllm.ipc._atomics",
            sources=["ipc/_atomics.c", "ipc/_ringops.c"],
            depends=["ipc/_atomics.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
        ),
        Extension(
            "ringllm.ipc._packer",
            sources=["ipc/_packer.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
        ),
        # The CPU kernels of the ops interface (pipeline/ops/cpu.py). -ffp-contract=off keeps
        # float32 arithmetic exactly as written (no fused multiply-adds the code did not ask
        # for), so results do not depend on the compiler's choices.
        Extension(
            "ringllm.pipeline.ops._cpu_ops",
            sources=[
                CPU_OPS + "cpu_ops_module.c",
                CPU_OPS + "cpu_ops_generic.c",
                CPU_OPS + "cpu_ops_avx512.c",
                CPU_OPS + "cpu_ops_avx512bf16.c",
            ],
            depends=[CPU_OPS + "cpu_ops.h", CPU_OPS + "cpu_ops_avx512.c"],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-fopenmp", "-ffp-contract=off"],
            extra_link_args=["-fopenmp"],
        ),
    ]
)
