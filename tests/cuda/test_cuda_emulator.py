"""The CPU emulator itself: barriers, deadlock reports, shuffles, indices, 16-bit
conversions, atomics, argument checking and launch limits, on small purpose-built kernels
whose right answers are computed here by hand (numpy / torch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ringllm.cuda.emulator import EmulatedModule, EmulatorError, compile_source, kernel_names
from ringllm.cuda.loader import paste_common

SOURCE = paste_common(
    r"""
#include "common.cuh"

// Shifts x left by one through shared memory; `synced` = 0 drops the barrier between
// the write and the read of a neighbour's element.
extern "C" __global__ void shift_in_shared(float* out, const float* x, int synced) {
  extern __shared__ float buffer[];
  const int t = threadIdx.x, n = blockDim.x;
  buffer[t] = x[t];
  if (synced) __syncthreads();
  out[t] = t + 1 < n ? buffer[t + 1] : 0.0f;
}

extern "C" __global__ void early_exit_then_barrier(float* out, int exiting_threads) {
  if ((int)threadIdx.x < exiting_threads) return;
  __syncthreads();
  out[threadIdx.x] = 1.0f;
}

// Half of warp 0 shuffles while the other half waits at __syncthreads.
extern "C" __global__ void shuffle_against_barrier(float* out) {
  float v = threadIdx.x;
  if (threadIdx.x < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
  else __syncthreads();
  out[threadIdx.x] = v;
}

extern "C" __global__ void shuffle_after_exit(float* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (float)threadIdx.x, 1);
}

// out[k][t]: the value thread t receives from shuffle variant k of v = x[t].
extern "C" __global__ void shuffles(float* out, const float* x) {
  const int t = threadIdx.x, n = blockDim.x;
  const float v = x[t];
  out[0 * n + t] = __shfl_xor_sync(0xffffffffu, v, 5);
  out[1 * n + t] = __shfl_sync(0xffffffffu, v, 7);
  out[2 * n + t] = __shfl_sync(0xffffffffu, v, 3, 8);
  out[3 * n + t] = __shfl_up_sync(0xffffffffu, v, 3);
  out[4 * n + t] = __shfl_down_sync(0xffffffffu, v, 3);
  out[5 * n + t] = __shfl_down_sync(0xffffffffu, v, 2, 16);
  out[6 * n + t] = ringllm::warp_sum(v);
  out[7 * n + t] = ringllm::warp_max(v);
  __shared__ float scratch[32];
  out[8 * n + t] = ringllm::block_sum(v, scratch);
}

// Records every thread's (blockIdx, threadIdx, blockDim, gridDim) at its global id.
extern "C" __global__ void indices(int* out) {
  const int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const int thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  int* row = out + 12 * (block * blockDim.x * blockDim.y * blockDim.z + thread);
  row[0] = blockIdx.x; row[1] = blockIdx.y; row[2] = blockIdx.z;
  row[3] = threadIdx.x; row[4] = threadIdx.y; row[5] = threadIdx.z;
  row[6] = blockDim.x; row[7] = blockDim.y; row[8] = blockDim.z;
  row[9] = gridDim.x; row[10] = gridDim.y; row[11] = gridDim.z;
}

extern "C" __global__ void read_dynamic_shared(float* out) {
  extern __shared__ float never_written[];
  out[threadIdx.x] = never_written[threadIdx.x];
}

extern "C" __global__ void to_16_bit(__half* halves, __nv_bfloat16* bfloats, float* back, const float* x, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    halves[i] = __float2half_rn(x[i]);
    bfloats[i] = __float2bfloat16_rn(x[i]);
    back[2 * i] = __half2float(halves[i]);
    back[2 * i + 1] = __bfloat162float(bfloats[i]);
  }
}

extern "C" __global__ void atomics(int* counter, int* maximum, float* total) {
  const int id = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(counter, 1);
  atomicMax(maximum, id);
  atomicAdd(total, 0.5f);
}

extern "C" __global__ void typed(float* out, float scale, int count, long long offset) {
  out[0] = scale * count + offset;
}
"""
)


@pytest.fixture(scope="module", params=["forward", "reverse"])
def module(request) -> EmulatedModule:
    return EmulatedModule(SOURCE, request.param)


@pytest.fixture(scope="module")
def both_orders() -> dict[str, EmulatedModule]:
    return {order: EmulatedModule(SOURCE, order) for order in ("forward", "reverse")}


def test_kernel_names_are_found_after_macro_expansion():
    names = kernel_names(
        paste_common(
            '#include "common.cuh"\n#define K(s) extern "C" __global__ void k_##s(float* x) {}\nK(a) K(b)'
        )
    )
    assert names == ["k_a", "k_b"]


def test_missing_barrier_gives_a_wrong_answer_in_one_order(both_orders):
    x = torch.arange(64, dtype=torch.float32)
    shifted = torch.cat([x[1:], torch.zeros(1)])
    results = {}
    for order, module in both_orders.items():
        kernel = module.get_function("shift_in_shared")
        synced, racy = torch.zeros(64), torch.zeros(64)
        kernel((1,), (64,), (synced, x, np.int32(1)), shared_mem=64 * 4)
        kernel((1,), (64,), (racy, x, np.int32(0)), shared_mem=64 * 4)
        assert torch.equal(synced, shifted), order
        results[order] = torch.equal(racy, shifted)
    assert results == {"forward": False, "reverse": True}


def test_barrier_some_threads_never_reach_is_a_deadlock(module):
    out = torch.zeros(64)
    with pytest.raises(
        EmulatorError, match="deadlock.*61 threads wait at __syncthreads.*3 have exited"
    ):
        module.get_function("early_exit_then_barrier")((2,), (64,), (out, np.int32(3)))
    module.get_function("early_exit_then_barrier")((2,), (64,), (out, np.int32(0)))
    assert torch.equal(out, torch.ones(64))


def test_shuffle_and_block_barrier_in_one_warp_is_a_deadlock(module):
    with pytest.raises(
        EmulatorError, match="deadlock.*16 threads wait at __syncthreads, 16 at a warp"
    ):
        module.get_function("shuffle_against_barrier")((1,), (32,), (torch.zeros(32),))


def test_shuffle_naming_an_exited_lane_is_reported(module):
    with pytest.raises(EmulatorError, match="names lane 16, which has exited"):
        module.get_function("shuffle_after_exit")((1,), (32,), (torch.zeros(32),))


def test_full_mask_shuffle_in_a_partial_warp_is_reported(module):
    with pytest.raises(EmulatorError, match="warp 1 has 8 threads but its warp operation's mask"):
        module.get_function("shuffles")((1,), (40,), (torch.zeros(9, 40), torch.zeros(40)))


def _expected_shuffles(x: np.ndarray) -> np.ndarray:
    """The CUDA shuffle rules, written out per lane: a source outside the caller's
    `width` segment leaves the caller's own value."""
    n = len(x)
    out = np.zeros((9, n), dtype=np.float32)
    for t in range(n):
        warp, lane = t // 32 * 32, t % 32
        own = x[t]
        out[0, t] = x[warp + (lane ^ 5)]
        out[1, t] = x[warp + 7]
        out[2, t] = x[warp + lane // 8 * 8 + 3]
        out[3, t] = x[t - 3] if lane >= 3 else own
        out[4, t] = x[t + 3] if lane + 3 < 32 else own
        out[5, t] = x[t + 2] if lane % 16 + 2 < 16 else own
        out[6, t] = x[warp : warp + 32].sum()
        out[7, t] = x[warp : warp + 32].max()
        out[8, t] = x.sum()
    return out


@pytest.mark.parametrize("num_threads", [32, 96, 1024])
def test_shuffles_and_reductions_follow_cuda_rules(module, num_threads):
    x = torch.randint(-50, 50, (num_threads,)).to(torch.float32)  # integers: exact sums
    out = torch.zeros(9, num_threads)
    module.get_function("shuffles")((1,), (num_threads,), (out, x))
    np.testing.assert_array_equal(out.numpy(), _expected_shuffles(x.numpy()))


def test_thread_and_block_indices_cover_a_3d_launch(module):
    grid, block = (3, 2, 2), (4, 2, 3)
    num = int(np.prod(grid) * np.prod(block))
    out = torch.full((num, 12), -1, dtype=torch.int32)
    module.get_function("indices")(grid, block, (out,))
    rows = {tuple(r) for r in out.tolist()}
    expected = {
        (bx, by, bz, tx, ty, tz, *block, *grid)
        for bx in range(3) for by in range(2) for bz in range(2)
        for tx in range(4) for ty in range(2) for tz in range(3)
    }  # fmt: skip
    assert rows == expected


def test_dynamic_shared_memory_starts_as_nan(module):
    out = torch.zeros(32)
    module.get_function("read_dynamic_shared")((1,), (32,), (out,), shared_mem=32 * 4)
    assert bool(out.isnan().all())


def test_16_bit_conversions_round_like_torch(module):
    specials = [0.0, -0.0, 1.0, 65504.0, 65520.0, 1e-8, 6e-8, 3e-5, 1 + 2**-11, 1 + 3 * 2**-11,
                1 + 2**-8, 1 + 3 * 2**-8, 3.0e38, float("inf"), float("-inf"), float("nan")]  # fmt: skip
    x = torch.cat([torch.tensor(specials), torch.randn(500) * 1000, torch.randn(500) * 1e-5])
    n = x.numel()
    halves = torch.empty(n, dtype=torch.float16)
    bfloats = torch.empty(n, dtype=torch.bfloat16)
    back = torch.empty(n, 2)
    module.get_function("to_16_bit")((1,), (128,), (halves, bfloats, back, x, np.int32(n)))
    torch.testing.assert_close(halves, x.to(torch.float16), atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(bfloats, x.to(torch.bfloat16), atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(
        back[:, 0], x.to(torch.float16).float(), atol=0, rtol=0, equal_nan=True
    )
    torch.testing.assert_close(
        back[:, 1], x.to(torch.bfloat16).float(), atol=0, rtol=0, equal_nan=True
    )


def test_atomics_accumulate_over_the_grid(module):
    counter, maximum = torch.zeros(1, dtype=torch.int32), torch.full((1,), -1, dtype=torch.int32)
    total = torch.zeros(1)
    module.get_function("atomics")((5,), (64,), (counter, maximum, total))
    assert counter.item() == 320 and maximum.item() == 319 and total.item() == 160.0


def test_scalar_arguments_need_their_exact_numpy_type(module):
    kernel = module.get_function("typed")
    out = torch.zeros(1)
    kernel((1,), (1,), (out, np.float32(1.5), np.int32(4), np.int64(-2)))
    assert out.item() == 4.0
    with pytest.raises(TypeError, match=r"argument 1 \(float32\): got a Python float.*np.float32"):
        kernel((1,), (1,), (out, 1.5, np.int32(4), np.int64(0)))
    with pytest.raises(TypeError, match=r"argument 2 \(int32\): got a Python int"):
        kernel((1,), (1,), (out, np.float32(1), 4, np.int64(0)))
    with pytest.raises(
        TypeError, match=r"argument 1 \(float32\): expected np.float32, got float64"
    ):
        kernel((1,), (1,), (out, np.float64(1), np.int32(4), np.int64(0)))
    with pytest.raises(TypeError, match=r"argument 3 \(int64\): expected np.int64, got int32"):
        kernel((1,), (1,), (out, np.float32(1), np.int32(4), np.int32(0)))


def test_pointer_arguments_need_a_cpu_tensor_of_the_pointee_dtype(module):
    kernel = module.get_function("typed")
    tail = (np.float32(1), np.int32(1), np.int64(0))
    with pytest.raises(
        TypeError, match=r"argument 0 \(float32\*\): expected a float32 tensor, got torch.float16"
    ):
        kernel((1,), (1,), (torch.zeros(1, dtype=torch.float16), *tail))
    with pytest.raises(
        TypeError, match=r"argument 0 \(float32\*\): expected a torch tensor, got ndarray"
    ):
        kernel((1,), (1,), (np.zeros(1, dtype=np.float32), *tail))
    with pytest.raises(TypeError, match="takes 4 arguments"):
        kernel((1,), (1,), (torch.zeros(1),))


def test_launch_limits_are_cuda_limits(module):
    out = torch.zeros(2048)
    with pytest.raises(EmulatorError, match="1025 threads exceeds CUDA's limit of 1024"):
        module.get_function("read_dynamic_shared")((1,), (1025,), (out,))
    with pytest.raises(EmulatorError, match="49156 bytes exceeds CUDA's default limit of 49152"):
        module.get_function("read_dynamic_shared")((1,), (32,), (out,), shared_mem=49156)
    with pytest.raises(ValueError, match="grid dimensions must be in"):
        module.get_function("read_dynamic_shared")((0,), (32,), (out,))


def test_builds_are_cached_by_source_and_compile_errors_are_reported(tmp_path):
    source = 'extern "C" __global__ void one(float* x) { x[threadIdx.x] = 1.0f; }'
    first = compile_source(source, ["one"], tmp_path)
    built_at = first.stat().st_mtime_ns
    assert (
        compile_source(source, ["one"], tmp_path) == first and first.stat().st_mtime_ns == built_at
    )
    assert compile_source(source + "\n", ["one"], tmp_path) != first
    with pytest.raises(EmulatorError, match="g\\+\\+ could not compile"):
        compile_source(
            'extern "C" __global__ void bad(float* x) { x[0] = undefined_name; }', ["bad"], tmp_path
        )


def test_portable_ucontext_fibers_run_the_same_kernels(tmp_path):
    for order in ("forward", "reverse"):
        module = EmulatedModule(
            SOURCE, order, cache_dir=tmp_path, defines=("RINGLLM_EMU_UCONTEXT",)
        )
        x = torch.randint(-50, 50, (96,)).to(torch.float32)
        out = torch.zeros(9, 96)
        module.get_function("shuffles")((1,), (96,), (out, x))
        np.testing.assert_array_equal(out.numpy(), _expected_shuffles(x.numpy()))
        with pytest.raises(EmulatorError, match="deadlock"):
            module.get_function("early_exit_then_barrier")(
                (1,), (64,), (torch.zeros(64), np.int32(3))
            )
