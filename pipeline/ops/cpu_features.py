"""What this CPU can run, asked once per process, and the choices the engine makes from it.

Every CPU-specific path asks here, never assumes: which C kernel set runs
(pipeline/ops/cpu.py), which weights are prepacked for oneDNN (pipeline/models/linear.py),
and which dtype `--dtype auto` runs a checkpoint in (pipeline/worker/model_loader.py).

Where the answers come from:

    the C extension's cpu_flags()    CPUID + XGETBV as libgcc reads them: exactly what the
                                     kernels' instructions need (the OS must save the wide
                                     registers too, or a flag reads as absent)
    torch's oneDNN checks            `_is_mkldnn_bf16_supported()` / `_fp16_`: the checks
                                     its weight-prepack op makes (it raises without them);
                                     they honour ONEDNN_MAX_CPU_ISA
    /proc/cpuinfo                    the model name (for reports) and, off x86, the flags

The x86-64 levels, each a superset of the one before:

    generic      any CPU (the portable C kernels)
    avx2         AVX2 + FMA + F16C            (Haswell and later, AMD Zen 1-3)
    avx512       + AVX-512 F/BW/VL/DQ         (Skylake-SP, Ice Lake, AMD Zen 4-5)
    avx512bf16   + AVX512_BF16, AVX512_VNNI   (Cooper / Sapphire Rapids, AMD Zen 4-5)

`RINGLLM_CPU_ISA=<level>` caps the level ringllm uses below what the CPU has. With
`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2` beside it, an AVX-512 machine chooses
everything as an AVX2 machine does (torch's and oneDNN's own code paths included): that is
how the suite proves the lesser paths on whichever machine it runs.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import torch

# After torch (see pipeline/ops/cpu.py: one OpenMP runtime for both).
from ringllm.pipeline.ops import cpu_kernels as _k

ISA_LEVELS = ("generic", "avx2", "avx512", "avx512bf16")
ENV_ISA = "RINGLLM_CPU_ISA"
_LEVEL_FLAGS = {  # what each level adds, as cpu_flags() names it
    "avx2": ("avx", "avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512bf16": ("avx512bf16", "avx512vnni"),  # every BF16 CPU has VNNI: its int8 dots
}


@dataclass(frozen=True)
class CpuFeatures:
    machine: str  # platform.machine(): x86_64, aarch64, ...
    model_name: str
    flags: frozenset[str]  # what the CPU reports
    hardware_isa: str  # the highest level of ISA_LEVELS the CPU runs
    isa: str  # the level ringllm uses: hardware_isa, or lower under RINGLLM_CPU_ISA
    onednn_bf16: bool  # torch's oneDNN multiplies (and prepacks) bfloat16 here
    onednn_fp16: bool  # ... and float16

    def has(self, level: str) -> bool:
        """Whether ringllm may use `level`'s instructions (the cap included)."""
        return ISA_LEVELS.index(self.isa) >= ISA_LEVELS.index(level)

    @property
    def capped(self) -> bool:
        return self.isa != self.hardware_isa

    @property
    def bf16_arithmetic(self) -> bool:
        """The CPU computes with bfloat16 natively (dot products of bf16 pairs into float32:
        AVX512_BF16, AMX-BF16, Arm's BF16 extension). Without it a bf16 matrix product is
        widened in software and runs several times slower than float32 (measured: ~5x on
        AVX2, ~3x on AVX-512 without BF16)."""
        if self.machine in ("x86_64", "AMD64"):
            amx = "amx-bf16" in self.flags and not self.capped
            return self.has("avx512bf16") or amx
        return "bf16" in self.flags

    @property
    def fp16_arithmetic(self) -> bool:
        """Native float16 arithmetic (AVX512_FP16, Arm's FP16 vector extension)."""
        if self.machine in ("x86_64", "AMD64"):
            return "avx512fp16" in self.flags and self.has("avx512")
        return "asimdhp" in self.flags

    def kernel_sets(self) -> tuple[str, ...]:
        """The C kernel sets ringllm may run here, slowest first."""
        built = tuple(_k.KERNEL_SETS)
        return tuple(
            name
            for name, ok in zip(built, _k.SUPPORTED, strict=True)
            if ok and name in ISA_LEVELS and self.has(name)
        )

    def prepacks(self, dtype: torch.dtype) -> bool:
        """Whether oneDNN's blocked layout takes weights of `dtype` here (models/linear.py).

        float32 on x86-64 always (oneDNN's packed product ran 1.5-2.8x faster than the BLAS
        product torch uses otherwise, on AVX2 and AVX-512 alike); bfloat16 / float16 only
        where torch's oneDNN takes them (its prepack op raises otherwise), and not under a
        cap below the level that op needs (AVX-512, or AVX-NE-CONVERT which no cap level
        names)."""
        if not (
            torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        ):
            return False
        if dtype == torch.float32:
            return self.machine in ("x86_64", "AMD64")
        wide_enough = not self.capped or self.has("avx512")
        if dtype == torch.bfloat16:
            return self.onednn_bf16 and wide_enough
        if dtype == torch.float16:
            return self.onednn_fp16 and wide_enough
        return False

    def auto_dtype(self, checkpoint: torch.dtype) -> torch.dtype:
        """The dtype `--dtype auto` runs a checkpoint of `checkpoint` in on this CPU: the
        checkpoint's own where the CPU computes in it natively, else float32 (weights
        widened once at load: exact, and the fastest product this CPU has)."""
        if checkpoint == torch.bfloat16:
            return torch.bfloat16 if self.bf16_arithmetic else torch.float32
        if checkpoint == torch.float16:
            if self.fp16_arithmetic and self.onednn_fp16:
                return torch.float16
            return torch.bfloat16 if self.bf16_arithmetic else torch.float32
        return checkpoint

    def describe(self) -> dict[str, object]:
        """A report of the facts and the choices (`ringllm cpu-info`, bench results)."""
        return {
            "machine": self.machine,
            "model_name": self.model_name,
            "hardware_isa": self.hardware_isa,
            "isa": self.isa,
            "flags": sorted(self.flags),
            "kernel_sets": list(self.kernel_sets()),
            "bf16_arithmetic": self.bf16_arithmetic,
            "fp16_arithmetic": self.fp16_arithmetic,
            "onednn_bf16": self.onednn_bf16,
            "onednn_fp16": self.onednn_fp16,
            "onednn_prepacks": [
                str(d).removeprefix("torch.")
                for d in (torch.float32, torch.bfloat16, torch.float16)
                if self.prepacks(d)
            ],
            "auto_dtype_of_bfloat16": str(self.auto_dtype(torch.bfloat16)).removeprefix("torch."),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        }


def hardware_level(flags: frozenset[str]) -> str:
    """The highest level of ISA_LEVELS whose flags (and every lower level's) are all here."""
    level = "generic"
    for name in ISA_LEVELS[1:]:
        if not all(f in flags for f in _LEVEL_FLAGS[name]):
            break
        level = name
    return level


def capped_level(hardware: str, cap: str | None) -> str:
    """`hardware`, lowered to `cap` (a RINGLLM_CPU_ISA value) when that is below it."""
    if not cap:
        return hardware
    cap = cap.strip().lower()
    if cap not in ISA_LEVELS:
        raise ValueError(f"{ENV_ISA}={cap!r}: not one of {', '.join(ISA_LEVELS)}")
    return ISA_LEVELS[min(ISA_LEVELS.index(hardware), ISA_LEVELS.index(cap))]


def _cpuinfo() -> tuple[str, frozenset[str]]:
    """The model name and the feature flags /proc/cpuinfo lists (empty where it is absent)."""
    name, flags = platform.processor() or "unknown", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "cpu model") and name in (
                    "",
                    "unknown",
                    platform.machine(),
                ):
                    name = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return name, flags


def _onednn_supports(name: str) -> bool:
    check = getattr(torch.ops.mkldnn, name, None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False


def detect(cap: str | None = None) -> CpuFeatures:
    """Asks this CPU (and torch) now; `cap` as RINGLLM_CPU_ISA would give it."""
    model_name, info_flags = _cpuinfo()
    machine = platform.machine()
    x86 = machine in ("x86_64", "AMD64")
    flags = frozenset(f for f, on in _k.cpu_flags().items() if on) if x86 else info_flags
    hardware = hardware_level(flags) if x86 else "generic"
    return CpuFeatures(
        machine=machine,
        model_name=model_name,
        flags=flags,
        hardware_isa=hardware,
        isa=capped_level(hardware, cap),
        onednn_bf16=_onednn_supports("_is_mkldnn_bf16_supported"),
        onednn_fp16=_onednn_supports("_is_mkldnn_fp16_supported"),
    )


@functools.cache
def cpu_features() -> CpuFeatures:
    """This process's answer (RINGLLM_CPU_ISA read once, at the first call)."""
    return detect(os.environ.get(ENV_ISA))
