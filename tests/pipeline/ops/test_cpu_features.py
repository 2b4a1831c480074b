"""Asking the CPU, then choosing: the ISA levels, the RINGLLM_CPU_ISA cap, the kernel sets,
oneDNN prepacking and `--dtype auto`, on this machine and on CPUs described by hand; every
weight layout (plain, oneDNN, ringllm's 16-bit product) against the others; and an AVX-512 machine made to choose as an AVX2
one (torch's and oneDNN's own caps beside ringllm's) serving the demo model end to end."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from ringllm.pipeline.models import linear
from ringllm.pipeline.ops import cpu_kernels
from ringllm.pipeline.ops.cpu_features import (
    ISA_LEVELS,
    CpuFeatures,
    capped_level,
    cpu_features,
    detect,
    hardware_level,
)

AVX2_FLAGS = frozenset({"avx", "avx2", "fma", "f16c"})
AVX512_FLAGS = AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
BF16_FLAGS = AVX512_FLAGS | {"avx512bf16", "avx512vnni"}
# What a bigger machine needs to choose everything as a lesser one does: an AVX2-only CPU
# (AMD Zen 3, Intel Haswell..Alder Lake) and an AVX-512 one without BF16 (Skylake-SP,
# Ice Lake). Each caps ringllm, oneDNN, torch's own kernels and MKL.
MACHINE_ENV = {
    "avx2": {
        "RINGLLM_CPU_ISA": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
    "avx512": {
        "RINGLLM_CPU_ISA": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
        "ATEN_CPU_CAPABILITY": "avx512",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
}


def described(flags, cap=None, machine="x86_64", onednn_bf16=None, **kw) -> CpuFeatures:
    """A CPU with these flags, as detect() would describe it."""
    hardware = hardware_level(frozenset(flags)) if machine == "x86_64" else "generic"
    if onednn_bf16 is None:  # torch's rule: AVX-512 F/BW/VL/DQ (or AVX-NE-CONVERT)
        onednn_bf16 = hardware in ("avx512", "avx512bf16")
    return CpuFeatures(
        machine=machine,
        model_name="described",
        flags=frozenset(flags),
        hardware_isa=hardware,
        isa=capped_level(hardware, cap),
        onednn_bf16=onednn_bf16,
        onednn_fp16=kw.pop("onednn_fp16", False),
        **kw,
    )


def test_levels_need_every_flag_of_every_level_below():
    assert hardware_level(frozenset()) == "generic"
    assert hardware_level(AVX2_FLAGS) == "avx2"
    assert hardware_level(AVX2_FLAGS - {"fma"}) == "generic"  # AVX2 without FMA: no set
    assert hardware_level(AVX512_FLAGS) == "avx512"
    assert hardware_level(BF16_FLAGS) == "avx512bf16"
    assert hardware_level(BF16_FLAGS - {"avx512vnni"}) == "avx512"  # its int8 dots want VNNI
    assert hardware_level(BF16_FLAGS - {"avx512vl"}) == "avx2"
    assert hardware_level(frozenset({"avx512bf16"})) == "generic"


def test_the_cap_lowers_never_raises_and_names_its_values():
    assert capped_level("avx512bf16", "avx2") == "avx2"
    assert capped_level("avx2", "avx512bf16") == "avx2"
    assert capped_level("avx512", None) == "avx512"
    assert capped_level("avx512", " AVX2 ") == "avx2"
    with pytest.raises(ValueError, match="RINGLLM_CPU_ISA='sse9'.*generic, avx2, avx512"):
        capped_level("avx512", "sse9")


def test_this_cpu_is_described_as_the_c_extension_and_torch_see_it():
    f = detect()
    assert f.isa == f.hardware_isa in ISA_LEVELS
    if f.machine == "x86_64":
        reported = cpu_kernels.cpu_flags()
        assert f.flags == {name for name, on in reported.items() if on}
        # the C module's own test of each set agrees with the level
        for name, ok in zip(cpu_kernels.KERNEL_SETS, cpu_kernels.SUPPORTED, strict=True):
            assert ok == (ISA_LEVELS.index(name) <= ISA_LEVELS.index(f.hardware_isa))
        assert f.kernel_sets() == ISA_LEVELS[: ISA_LEVELS.index(f.isa) + 1]
    assert f.onednn_bf16 == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert f.kernel_sets()[0] == "generic"


@pytest.mark.parametrize("cap", ISA_LEVELS)
def test_kernel_sets_stop_at_the_cap(cap):
    f = detect(cap)
    assert f.kernel_sets()[-1] == capped_level(f.hardware_isa, cap)
    assert all(ISA_LEVELS.index(s) <= ISA_LEVELS.index(cap) for s in f.kernel_sets())


@pytest.mark.parametrize(
    "flags, cap, bf16_dtype",
    [
        (AVX2_FLAGS, None, torch.float32),  # Zen 3: bf16 products ~5x slower than float32
        (AVX512_FLAGS, None, torch.float32),  # Skylake-SP / Ice Lake: no bf16 arithmetic
        (BF16_FLAGS, None, torch.bfloat16),  # Zen 4-5, Sapphire Rapids
        (BF16_FLAGS, "avx512", torch.float32),  # capped below the BF16 instructions
        (AVX512_FLAGS | {"amx-tile", "amx-bf16"}, None, torch.bfloat16),
        (frozenset(), None, torch.float32),
    ],
)
def test_auto_dtype_is_the_dtype_the_cpu_computes_in(flags, cap, bf16_dtype):
    f = described(flags, cap)
    assert f.auto_dtype(torch.bfloat16) == bf16_dtype
    assert f.auto_dtype(torch.float32) == torch.float32
    # float16 checkpoints: bf16 where that is native, else float32
    assert f.auto_dtype(torch.float16) == (
        torch.bfloat16 if bf16_dtype == torch.bfloat16 else torch.float32
    )


def test_arm_cpus_read_their_features_from_cpuinfo():
    arm = described({"fp", "asimd", "bf16", "asimdhp"}, machine="aarch64", onednn_fp16=True)
    assert arm.isa == "generic" and arm.bf16_arithmetic and arm.fp16_arithmetic
    assert arm.auto_dtype(torch.float16) == torch.float16
    assert not arm.prepacks(torch.float32)  # oneDNN's float32 packing is an x86-64 measurement
    plain = described({"fp", "asimd"}, machine="aarch64")
    assert plain.auto_dtype(torch.bfloat16) == torch.float32


def test_prepacking_follows_onednn_and_the_cap():
    assert described(BF16_FLAGS).prepacks(torch.bfloat16)
    assert described(BF16_FLAGS).prepacks(torch.float32)
    # the Zen 3 failure: oneDNN refuses bf16 weights on an AVX2-only CPU
    assert not described(AVX2_FLAGS).prepacks(torch.bfloat16)
    assert described(AVX2_FLAGS).prepacks(torch.float32)
    # a cap below AVX-512 turns bf16 packing off even where oneDNN would take it
    assert not described(BF16_FLAGS, cap="avx2").prepacks(torch.bfloat16)
    assert not described(BF16_FLAGS).prepacks(torch.float16)  # no AVX512_FP16 here


def test_the_process_answer_reads_its_environment_once(monkeypatch):
    monkeypatch.setenv("RINGLLM_CPU_ISA", "generic")
    cpu_features.cache_clear()
    try:
        f = cpu_features()
        assert f.isa == "generic" and f.kernel_sets() == ("generic",)
        monkeypatch.setenv("RINGLLM_CPU_ISA", "avx1024")
        cpu_features.cache_clear()
        with pytest.raises(ValueError, match="RINGLLM_CPU_ISA='avx1024'"):
            cpu_features()
    finally:
        monkeypatch.undo()
        cpu_features.cache_clear()


def test_the_layout_policy_names_its_values(monkeypatch):
    monkeypatch.setenv("RINGLLM_WEIGHT_LAYOUT", "fastest")
    linear.layout_policy.cache_clear()
    try:
        with pytest.raises(
            ValueError, match="RINGLLM_WEIGHT_LAYOUT='fastest'.*auto, onednn, plain"
        ):
            linear.layout_policy()
    finally:
        monkeypatch.undo()
        linear.layout_policy.cache_clear()


# ---- the packed product and the plain one ---------------------------------------------


def test_small_matrices_stay_plain():
    """Below MIN_PACKED_ELEMENTS a packed product's fixed cost per call is not earned back."""
    small = torch.randn(256, 256)
    assert small.numel() < linear.MIN_PACKED_ELEMENTS
    assert linear.layout(linear.prepack(small)) == "plain"
    widened = linear.prepack(small.bfloat16(), compute=torch.float32)
    assert linear.layout(widened) == "plain" and widened.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prepack_is_used_exactly_where_the_cpu_takes_it_and_matches_f_linear(dtype):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(640, 256, generator=gen).to(dtype)
    x = torch.randn(7, 256, generator=gen).to(dtype)
    packed = linear.prepack(w)
    assert packed.is_mkldnn == cpu_features().prepacks(dtype)
    assert not linear.prepack(w, enabled=False).is_mkldnn
    want = torch.nn.functional.linear(x.float(), w.float())
    tol = 3e-5 if dtype == torch.float32 else 6e-2
    assert torch.allclose(linear.linear(x, packed).float(), want, rtol=tol, atol=4 * tol)


def test_a_prepack_op_that_fails_leaves_weights_plain(monkeypatch):
    """A CPU the feature checks misjudge: the probe catches oneDNN's refusal at load."""

    def refuse(weight, batch):
        raise RuntimeError("bf16 path needs the cpu support avx_ne_convert or avx512bw")

    monkeypatch.setattr(linear, "pack_onednn", lambda w: refuse(w, 64))
    linear._probe.cache_clear()
    try:
        w = torch.randn(512, 512)
        assert linear.prepack(w) is w
    finally:
        monkeypatch.undo()
        linear._probe.cache_clear()


@contextlib.contextmanager
def layout_policy(policy: str):
    """RINGLLM_WEIGHT_LAYOUT=policy for the models loaded inside."""
    saved = os.environ.get("RINGLLM_WEIGHT_LAYOUT")
    os.environ["RINGLLM_WEIGHT_LAYOUT"] = policy
    linear.layout_policy.cache_clear()
    linear._ringllm16_set.cache_clear()
    try:
        yield
    finally:
        if saved is None:
            del os.environ["RINGLLM_WEIGHT_LAYOUT"]
        else:
            os.environ["RINGLLM_WEIGHT_LAYOUT"] = saved
        linear.layout_policy.cache_clear()
        linear._ringllm16_set.cache_clear()


@pytest.mark.parametrize("checkpoint", ["float32", "bfloat16"])
def test_every_weight_layout_gives_the_same_answers(model_factory, checkpoint):
    """The plain path (F.linear everywhere), oneDNN's packed one and ringllm's 16-bit one,
    on a float32 run: the same greedy tokens, logits within 1e-4 (each is also held to
    transformers by test_models.py)."""
    from tests.pipeline.models.test_models import (
        PACKED_SHAPE,
        make_runner,
        random_prompts,
        run_chunked_then_greedy,
    )

    path = model_factory("qwen2", dtype=checkpoint, **PACKED_SHAPE)
    results, seen = [], []
    for policy in ("auto", "onednn", "plain"):
        with layout_policy(policy):
            runner = make_runner(path, dtype="float32")
            seen.append(linear.layout(runner.model.layers[0].qkv))
            results.append(run_chunked_then_greedy(runner, random_prompts(runner.arch.vocab_size)))
    onednn = "onednn" if cpu_features().prepacks(torch.float32) else "plain"
    ringllm16 = checkpoint == "bfloat16" and linear._ringllm16_set() is not None
    assert seen == ["ringllm16" if ringllm16 else onednn, onednn, "plain"]
    (logits_a, _, tokens_a) = results[0]
    for logits_b, _, tokens_b in results[1:]:
        assert tokens_a == tokens_b
        for a, b in zip(logits_a, logits_b, strict=True):
            assert (a - b).abs().max().item() <= 1e-4


# ---- lesser machines, emulated end to end ----------------------------------------------


def _run_as(machine: str, code: str) -> str:
    if ISA_LEVELS.index(detect().hardware_isa) < ISA_LEVELS.index(machine):
        pytest.skip(
            f"this CPU cannot stand in for an {machine} one (it is {detect().hardware_isa})"
        )
    env = {**os.environ, **MACHINE_ENV[machine]}
    for name in ("RINGLLM_CPU_KERNELS", "RINGLLM_WEIGHT_LAYOUT", "RINGLLM_QUANT_KERNELS"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_an_avx2_machine_chooses_avx2_kernels_float32_and_no_bf16_packing():
    out = _run_as(
        "avx2",
        "import json; from ringllm.tools.cpu_info import report; print(json.dumps(report()))",
    )
    info = json.loads(out.strip().splitlines()[-1])
    assert info["isa"] == "avx2" and info["default_kernel_set"] == "avx2"
    assert info["kernel_sets"] == ["generic", "avx2"]
    assert info["torch_cpu_capability"] == "AVX2"
    assert not info["onednn_bf16"]  # oneDNN itself now refuses bf16, as on Zen 3
    assert info["onednn_prepacks"] == ["float32"]
    assert info["auto_dtype_of_bfloat16"] == "float32"
    assert info["bfloat16_checkpoint_matrices"] == "bfloat16"  # widened in registers
    assert info["quant_kernel_set"] == "avx2" and info["bfloat16_checkpoint_auto"] == "float32"


@pytest.mark.parametrize("machine", ["avx2", "avx512"])
def test_the_demo_model_answers_paris_on_lesser_machines(machine):
    """The demo model's bf16 folder with --dtype auto (the README's first path until the
    demo was served as its GGUF) where an issue found it dead: oneDNN's bf16 prepack raised on the AVX2-only CPU. Neither class
    has bf16 arithmetic: float32 products of the bf16 matrices, that class's kernels."""
    out = _run_as(
        machine,
        "from ringllm.pipeline import LLM, SamplingParams\n"
        "from ringllm.pipeline.models.demo_model import demo_model_path\n"
        "llm = LLM(str(demo_model_path()), kv_cache_memory_bytes=64 << 20, max_num_seqs=4)\n"
        "runner = llm.llm_engine.engine_core.executor.runner\n"
        "from ringllm.pipeline.models.linear import layout\n"
        "print(runner.dtype, runner.ops.kernel_set, layout(runner.model.layers[0].qkv))\n"
        "q = [{'role': 'user', 'content': 'What is the capital of France?'}]\n"
        "print(llm.chat(q, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)"
        "[0].outputs[0].text)\n",
    )
    chosen, answer = out.strip().splitlines()[-2:]
    assert chosen == f"torch.float32 {machine} ringllm16"  # bf16 matrices, float32 products
    assert "Paris" in answer


@pytest.mark.parametrize("machine", ["avx2", "avx512"])
def test_the_demo_gguf_runs_that_levels_quantized_kernels(machine):
    """The README's first path now (the demo model's GGUF as it is) on each lesser level:
    RINGLLM_CPU_ISA caps the quantized kernels' set as it caps the others."""
    out = _run_as(
        machine,
        "from ringllm.pipeline import LLM, SamplingParams\n"
        "from ringllm.pipeline.ops.quant import default_kernel_set\n"
        "llm = LLM(kv_cache_memory_bytes=64 << 20, max_num_seqs=4)\n"
        "print(default_kernel_set())\n"
        "q = [{'role': 'user', 'content': 'Name the capital of France.'}]\n"
        "print(llm.chat(q, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)"
        "[0].outputs[0].text)\n",
    )
    chosen, answer = out.strip().splitlines()[-2:]
    from ringllm.pipeline.ops.quant import kernel_sets

    vnni = "avx512vnni" in kernel_sets()
    assert chosen == {"avx2": "avx2", "avx512": "avx512vnni" if vnni else "avx512"}[machine]
    assert "Paris" in answer


def test_features_are_a_frozen_record():
    f = detect()
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.isa = "generic"  # type: ignore[misc]
