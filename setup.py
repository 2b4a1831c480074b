"""Only the C extensions live here; everything else is in setup.cfg."""

from setuptools import Extension, setup

CPU_OPS = "pipeline/ops/csrc/"
CPU_OPS_HEADERS = [
    "cpu_ops.h",
    "decode_layers.h",
    "simd_kernels.h",
    "attention_tiles.h",
    "amx.h",
    "simd_gemm.h",
    "simd_avx2.h",
    "simd_avx512.h",
]
QUANT = "pipeline/ops/csrc/quant/"
QUANT_HEADERS = [
    "quant.h",
    "quant_decode.h",
    "quant_acts.h",
    "quant_gemm.h",
    "quant_kq.h",
    "quant_avx512.h",
    "quant_bf16.h",
]
KERNEL_FLAGS = ["-O3", "-std=gnu11", "-Wall", "-fopenmp", "-ffp-contract=off"]

setup(
    ext_modules=[
        Extension(
            "ringllm.ipc._atomics",
            sources=["ipc/_atomics.c", "ipc/_ringops.c"],
            depends=["ipc/_atomics.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
        ),
        Extension(
            "ringllm.ipc.probes",
            sources=["ipc/probes.c"],
            depends=["ipc/_atomics.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
        ),
        Extension(
            "ringllm.ipc._packer",
            sources=["ipc/_packer.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
        ),
        # The CPU kernels of the ops interface (pipeline/ops/cpu.py). The SIMD sets are
        # compiled for their instruction sets by `#pragma GCC target` in their own files
        # (empty on other CPUs), so the flags here are those of any x86-64 / aarch64 build and
        # the module imports on every CPU. -ffp-contract=off keeps
        # float32 arithmetic exactly as written (no fused multiply-adds the code did not ask
        # for), so results do not depend on the compiler's choices.
        Extension(
            "ringllm.pipeline.ops.cpu_kernels",
            sources=[
                CPU_OPS + "cpu_ops_module.c",
                CPU_OPS + "cpu_ops_generic.c",
                CPU_OPS + "cpu_ops_avx2.c",
                CPU_OPS + "cpu_ops_avx512.c",
                CPU_OPS + "cpu_ops_avx512bf16.c",
                CPU_OPS + "decode_layers.c",
            ],
            depends=[CPU_OPS + h for h in CPU_OPS_HEADERS] + [QUANT + "quant.h"],
            extra_compile_args=KERNEL_FLAGS,
            extra_link_args=["-fopenmp"],
        ),
        # The quantized matrix kernels (pipeline/ops/quant.py): GGUF block types and int8
        # weights against int8-quantized activations. Built like cpu_kernels: one file per
        # SIMD set, each under its own `#pragma GCC target`.
        Extension(
            "ringllm.pipeline.ops.quant_kernels",
            sources=[
                QUANT + "quant_module.c",
                QUANT + "quant_layout.c",
                QUANT + "quant_generic.c",
                QUANT + "quant_avx2.c",
                QUANT + "quant_avx512.c",
                QUANT + "quant_avx512vnni.c",
                QUANT + "quant_avx512bf16.c",
                QUANT + "quant_avx512amx.c",
            ],
            depends=[QUANT + h for h in QUANT_HEADERS] + [CPU_OPS + "amx.h"],
            extra_compile_args=KERNEL_FLAGS,
            extra_link_args=["-fopenmp"],
        ),
    ]
)
