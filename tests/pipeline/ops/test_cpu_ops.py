"""The C kernels of CpuOps (every kernel set this CPU runs) against the torch reference and dense float64
attention: every op, every dtype, GQA shapes, odd head sizes and block sizes, tiles of
query tokens, bounds checks, and the fallback to TorchOps for layouts the kernels skip."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_torch_ops import dense_kv, dense_reference

from ringllm.pipeline.ops import TorchOps, get_ops
from ringllm.pipeline.ops.cpu import CpuOps, kernel_sets
from ringllm.pipeline.ops.rope import cos_sin_cache

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Largest error of an output rounded once to the dtype, for values of magnitude ~1.
OUT_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.fixture(params=kernel_sets())
def ops(request):
    return CpuOps(request.param)


def close_in_dtype(a, b, dtype):
    """a and b differ by at most two units in the last place of a 16-bit dtype (a float32
    statistic summed in another order may round one intermediate the other way, and the
    product after it once more); float32: a few units."""
    ulps = 16 if dtype == torch.float32 else 2
    info = torch.finfo(dtype)
    a, b = a.double(), b.double()
    return bool(
        ((a - b).abs() <= ulps * info.eps * torch.maximum(a.abs(), b.abs()) + info.tiny).all()
    )


# ---- attention ---------------------------------------------------------------------------

SHAPES = [  # num_heads, num_kv_heads, head_size, block_size
    (4, 4, 16, 8),
    (9, 3, 64, 16),
    (6, 1, 80, 16),
    (32, 4, 128, 32),
    (2, 2, 24, 4),
]


def make_cache(num_kv_heads, block_size, head_size, contexts, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in contexts)
    num_blocks = len(contexts) * max_blocks + 3
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)[: len(contexts) * max_blocks]
    return key_cache, value_cache, perm.view(len(contexts), max_blocks).to(torch.int32), gen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_matches_dense_attention(ops, shape, dtype):
    num_heads, num_kv_heads, head_size, block_size = shape
    # cached prefix = context - q_len; 70 new tokens span more than one tile of queries
    contexts, q_lens = [9, 40, 17, 100, 70], [9, 12, 1, 30, 70]
    key_cache, value_cache, tables, gen = make_cache(
        num_kv_heads, block_size, head_size, contexts, dtype, seed=0
    )
    query = torch.randn(sum(q_lens), num_heads, head_size, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    scale = head_size**-0.5
    out = ops.paged_attention_prefill(
        query, key_cache, value_cache, tables, starts, seq_lens, scale
    )
    assert out.dtype == dtype and out.shape == query.shape
    for r, (n, q_len) in enumerate(zip(contexts, q_lens, strict=True)):
        k, v = dense_kv(key_cache, tables[r], n), dense_kv(value_cache, tables[r], n)
        ref = dense_reference(query[starts[r] : starts[r + 1]], k, v, n - q_len, scale)
        got = out[starts[r] : starts[r + 1]].double()
        assert torch.allclose(got, ref, atol=OUT_TOL[dtype], rtol=OUT_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_matches_dense_attention(ops, shape, dtype):
    num_heads, num_kv_heads, head_size, block_size = shape
    contexts = [1, block_size - 1, block_size, block_size + 1, 70]
    key_cache, value_cache, tables, gen = make_cache(
        num_kv_heads, block_size, head_size, contexts, dtype, seed=1
    )
    query = torch.randn(len(contexts), num_heads, head_size, generator=gen).to(dtype)
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    out = ops.paged_attention_decode(query, key_cache, value_cache, tables, seq_lens, 0.2)
    reference_ops = TorchOps().paged_attention_decode(
        query, key_cache, value_cache, tables, seq_lens, 0.2
    )
    for r, n in enumerate(contexts):
        k, v = dense_kv(key_cache, tables[r], n), dense_kv(value_cache, tables[r], n)
        ref = dense_reference(query[r : r + 1], k, v, n - 1, 0.2)
        assert torch.allclose(
            out[r : r + 1].double(), ref, atol=OUT_TOL[dtype], rtol=OUT_TOL[dtype]
        )
        # float32 accumulation throughout: never further from the truth than the torch
        # reference, which rounds scores and partial sums to the cache dtype
        err = (out[r : r + 1].double() - ref).abs().max()
        ref_err = (reference_ops[r : r + 1].double() - ref).abs().max()
        assert err <= ref_err + OUT_TOL[dtype] / 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 4, 16, 8), (9, 3, 64, 16), (8, 1, 80, 4)])
@pytest.mark.parametrize("window", [1, 5, 19, 64, 1000])
def test_a_sliding_window_matches_dense_attention(ops, shape, dtype, window):
    """A sliding-window layer's prefill (chunks after cached prefixes, 70 new tokens over
    two tiles of queries) and decode: windows within a block, across blocks and chunks of
    keys, and past every context."""
    num_heads, num_kv_heads, head_size, block_size = shape
    contexts, q_lens = [9, 40, 17, 150, 70], [9, 12, 1, 30, 70]
    key_cache, value_cache, tables, gen = make_cache(
        num_kv_heads, block_size, head_size, contexts, dtype, seed=4
    )
    query = torch.randn(sum(q_lens), num_heads, head_size, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    scale = head_size**-0.5
    out = ops.paged_attention_prefill(
        query, key_cache, value_cache, tables, starts, seq_lens, scale, sliding_window=window
    )
    last = query[starts[1:] - 1]
    decoded = ops.paged_attention_decode(
        last, key_cache, value_cache, tables, seq_lens, scale, sliding_window=window
    )
    for r, (n, q_len) in enumerate(zip(contexts, q_lens, strict=True)):
        k, v = dense_kv(key_cache, tables[r], n), dense_kv(value_cache, tables[r], n)
        ref = dense_reference(query[starts[r] : starts[r + 1]], k, v, n - q_len, scale, window)
        got = out[starts[r] : starts[r + 1]].double()
        assert torch.allclose(got, ref, atol=OUT_TOL[dtype], rtol=OUT_TOL[dtype])
        assert torch.allclose(
            decoded[r].double(), ref[-1], atol=OUT_TOL[dtype], rtol=OUT_TOL[dtype]
        )


def test_attention_does_not_depend_on_the_batch_or_threads(ops):
    """A request's output is the same bits alone, in a batch, and with 1 or 2 threads."""
    contexts = [33, 7, 64, 120]
    key_cache, value_cache, tables, gen = make_cache(2, 16, 64, contexts, torch.bfloat16, 2)
    query = torch.randn(len(contexts), 8, 64, generator=gen).to(torch.bfloat16)
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    batched = ops.paged_attention_decode(query, key_cache, value_cache, tables, seq_lens, 0.125)
    single_thread = CpuOps(ops.kernel_set, threads=1)
    for r in range(len(contexts)):
        alone = single_thread.paged_attention_decode(
            query[r : r + 1], key_cache, value_cache, tables[r : r + 1], seq_lens[r : r + 1], 0.125
        )
        assert torch.equal(alone, batched[r : r + 1])


def test_prefill_reads_strided_query_rows(ops):
    """The query as the models pass it: a view into the fused qkv rows."""
    contexts = [20, 5]  # 4 and 5 new tokens
    key_cache, value_cache, tables, gen = make_cache(2, 8, 32, contexts, torch.float32, 3)
    qkv = torch.randn(9, (4 + 2 + 2) * 32, generator=gen)
    query = qkv[:, : 4 * 32].view(9, 4, 32)
    starts = torch.tensor([0, 4, 9], dtype=torch.int32)
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    args = (key_cache, value_cache, tables, starts, seq_lens, 0.3)
    strided = ops.paged_attention_prefill(query, *args)
    dense = ops.paged_attention_prefill(query.contiguous(), *args)
    assert torch.equal(strided, dense)


# ---- elementwise ops ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 100, 7])
def test_rms_norm_matches_torch(ops, dtype, hidden):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(13, hidden, generator=gen).to(dtype)
    residual = torch.randn(13, hidden, generator=gen).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    ref = TorchOps()
    assert close_in_dtype(ops.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5), dtype)
    out, h = ops.rms_norm(x, weight, 1e-6, residual)
    ref_out, ref_h = ref.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(h, ref_h)  # the residual sum is rounded exactly as torch rounds it
    assert close_in_dtype(out, ref_out, dtype)


def test_rms_norm_of_heads_in_fused_rows(ops):
    """Qwen3's per-head q/k norm: [T, H, D] views into the qkv rows."""
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(6, 8 * 16, generator=gen).to(torch.bfloat16)
    k = qkv[:, 4 * 16 : 6 * 16].view(6, 2, 16)
    weight = torch.randn(16, generator=gen).to(torch.bfloat16)
    got = ops.rms_norm(k, weight, 1e-6)
    want = TorchOps().rms_norm(k, weight, 1e-6)
    assert got.shape == (6, 2, 16) and close_in_dtype(got, want, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 80, 6])
def test_rotary_matches_torch(ops, dtype, head_size):
    gen = torch.Generator().manual_seed(6)
    table = cos_sin_cache(head_size, 300, 10000.0, None)
    positions = torch.randint(0, 300, (11,), generator=gen)
    for fused in (True, False):
        if fused:  # q and k neighbouring slices of the qkv rows (rotated in one pass)
            qkv = torch.randn(11, 7 * head_size, generator=gen).to(dtype)
            q, k = qkv[:, : 4 * head_size], qkv[:, 4 * head_size : 6 * head_size]
            q, k = q.view(11, 4, head_size), k.view(11, 2, head_size)
        else:
            q = torch.randn(11, 4, head_size, generator=gen).to(dtype)
            k = torch.randn(11, 2, head_size, generator=gen).to(dtype)
        q_ref, k_ref = q.clone(), k.clone()
        ops.rotary_embedding(positions, q, k, table)
        TorchOps().rotary_embedding(positions, q_ref, k_ref, table)
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 40, 3])
def test_silu_and_mul_matches_torch(ops, dtype, inter):
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(9, 2 * inter, generator=gen) * 4).to(dtype)
    assert close_in_dtype(ops.silu_and_mul(x), TorchOps().silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [2048, 40, 3])
def test_gelu_tanh_and_mul_matches_float64(ops, dtype, inter):
    """Against GELU(tanh) in float64 written as g * sigmoid(2u) (the same function as
    g / 2 * (1 + tanh(u))), rounded where the op rounds: the activation, then the product.
    Not against torch's: its 1 + tanh(u) cancels for negative gates, in float32 (-1.0275e-4
    at g = -4.18 where float64 says -1.0286e-4) and in float64 (0 below g = -8)."""
    gen = torch.Generator().manual_seed(17)
    x = (torch.randn(9, 2 * inter, generator=gen) * 4).to(dtype)
    gate, up = x.double().chunk(2, dim=-1)
    z = 2 * math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)
    want = ((gate * torch.sigmoid(z)).to(dtype).double() * up).to(dtype).double()
    got = ops.gelu_tanh_and_mul(x).double()
    # sigmoid(z) for z < 0 is about exp(z): z's own float32 rounding (|z| ulps) carries over
    ulps = 16 + 4 * z.abs() if dtype == torch.float32 else 2
    bound = ulps * torch.finfo(dtype).eps * torch.maximum(got.abs(), want.abs()) + 1e-30
    assert ((got - want).abs() <= bound).all(), ((got - want).abs() - bound).max()
    # torch's float32 loses |g * up| * eps to the cancellation, not more
    got32, torch32 = ops.gelu_tanh_and_mul(x.float()), TorchOps().gelu_tanh_and_mul(x.float())
    scale = (gate * up).abs().float() * torch.finfo(torch.float32).eps
    assert ((got32 - torch32).abs() <= 1e-5 * torch32.abs() + 4 * scale).all()


def test_gelu_tanh_at_extremes(ops):
    """Written as a sigmoid, GELU(tanh) leaves ~1e-8 where torch's tanh rounds to -1 (a
    gate below about -4.5): within 1e-7 of torch's everywhere, exact for large gates."""
    x = torch.tensor([[-1e30, -200.0, -9.0, -4.0, 0.0, 0.5, 4.0, 90.0, 1e30] + [1.0] * 9])
    got, want = ops.gelu_tanh_and_mul(x), TorchOps().gelu_tanh_and_mul(x)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), (got - want).abs().max()
    assert got[0, -1] == 1e30 and got[0, 4] == 0


def test_silu_at_extremes(ops):
    x = torch.tensor([[-200.0, -90.0, 0.0, 90.0, 1e30, 1.0, 1.0, 1.0, 1.0, 1.0]])
    got, want = ops.silu_and_mul(x), TorchOps().silu_and_mul(x)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_matches_torch(ops, dtype):
    gen = torch.Generator().manual_seed(8)
    qkv = torch.randn(5, (2 + 2 + 2) * 16, generator=gen).to(dtype)
    key, value = qkv[:, 32:64].view(5, 2, 16), qkv[:, 64:].view(5, 2, 16)
    slots = torch.tensor([3, -1, 17, 0, 31])
    caches = [torch.zeros(4, 2, 8, 16, dtype=dtype) for _ in range(4)]
    ops.reshape_and_cache(key, value, caches[0], caches[1], slots)
    TorchOps().reshape_and_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


# ---- bounds and fallbacks -------------------------------------------------------------------


def test_out_of_range_indices_raise(ops):
    key_cache, value_cache, tables, gen = make_cache(1, 4, 8, [8, 8], torch.float32, 9)
    query = torch.randn(2, 2, 8, generator=gen)
    with pytest.raises(ValueError, match="slot"):
        ops.reshape_and_cache(
            query[:, :1], query[:, :1], key_cache, value_cache, torch.tensor([0, 999])
        )
    bad = tables.clone()
    bad[1, 1] = key_cache.shape[0]
    with pytest.raises(ValueError, match="block ids"):
        ops.paged_attention_decode(
            query, key_cache, value_cache, bad, torch.tensor([8, 8], dtype=torch.int32), 1.0
        )
    with pytest.raises(ValueError, match="columns"):
        ops.paged_attention_decode(
            query, key_cache, value_cache, tables, torch.tensor([8, 9], dtype=torch.int32), 1.0
        )
    with pytest.raises(ValueError, match="more new tokens"):
        ops.paged_attention_prefill(
            torch.randn(5, 2, 8),
            key_cache,
            value_cache,
            tables,
            torch.tensor([0, 1, 5], dtype=torch.int32),
            torch.tensor([1, 3], dtype=torch.int32),
            1.0,
        )
    table = cos_sin_cache(8, 16, 10000.0, None)
    with pytest.raises(ValueError, match="positions"):
        ops.rotary_embedding(torch.tensor([0, 16]), query, query.clone(), table)


def test_layouts_the_kernels_skip_fall_back_to_torch(ops):
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(8, 6, generator=gen).t()  # last dim not contiguous
    weight = torch.randn(8, generator=gen)
    assert torch.equal(ops.rms_norm(x, weight, 1e-5), TorchOps().rms_norm(x, weight, 1e-5))
    y = torch.randn(4, 10, dtype=torch.float64, generator=gen)  # no kernel for float64
    assert torch.equal(ops.silu_and_mul(y), TorchOps().silu_and_mul(y))


def test_attention_with_more_query_heads_per_kv_head_than_a_work_item_holds(ops):
    """72 query heads on one KV head: past the kernels' 64 rows, so TorchOps answers."""
    key_cache, value_cache, tables, gen = make_cache(1, 8, 16, [20, 3], torch.float32, 12)
    query = torch.randn(2, 72, 16, generator=gen)
    seq_lens = torch.tensor([20, 3], dtype=torch.int32)
    got = ops.paged_attention_decode(query, key_cache, value_cache, tables, seq_lens, 0.25)
    want = TorchOps().paged_attention_decode(query, key_cache, value_cache, tables, seq_lens, 0.25)
    assert torch.equal(got, want)


def test_get_ops_picks_the_kernels(monkeypatch):
    monkeypatch.delenv("RINGLLM_CPU_KERNELS", raising=False)
    ops = get_ops("cpu")
    assert isinstance(ops, CpuOps) and ops.kernel_set == kernel_sets()[-1]
    monkeypatch.setenv("RINGLLM_CPU_KERNELS", "torch")
    assert type(get_ops("cpu")) is TorchOps
    monkeypatch.setenv("RINGLLM_CPU_KERNELS", "generic")
    assert get_ops("cpu").kernel_set == "generic"
    monkeypatch.setenv("RINGLLM_CPU_KERNELS", "sse9")
    with pytest.raises(ValueError, match="RINGLLM_CPU_KERNELS"):
        get_ops("cpu")
    with pytest.raises(ValueError, match="kernel_set"):
        CpuOps("sse9")


def test_argmax_uses_the_process_kernel_set(monkeypatch):
    from ringllm.pipeline.ops import cpu

    cpu._argmax_set.cache_clear()
    try:
        monkeypatch.setenv("RINGLLM_CPU_KERNELS", "generic")
        assert cpu._argmax_set() == 0
        cpu._argmax_set.cache_clear()
        monkeypatch.setenv("RINGLLM_CPU_KERNELS", "torch")
        assert cpu._argmax_set() is None
        x = torch.randn(3, 50)
        assert torch.equal(cpu.argmax_rows(x), x.argmax(-1))
    finally:
        monkeypatch.undo()
        cpu._argmax_set.cache_clear()


def test_kernels_share_torchs_openmp_runtime():
    """One OpenMP runtime for torch and the kernels: the kernels' libgomp is torch's own
    copy. Checked in a fresh process: another package of this one (sentencepiece, say)
    may bring its own copy, which is not the kernels' doing."""
    import subprocess
    import sys

    code = (
        "import json, torch, ringllm.pipeline.ops.cpu_kernels\n"
        "print(json.dumps(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    paths = json.loads(out.stdout)
    assert len(paths) == 1 and "torch" in paths[0], paths


@pytest.mark.parametrize("kernel_set", kernel_sets())
@pytest.mark.parametrize("cols", [49152, 37, 16, 9, 1])
def test_argmax_rows_matches_torch(cols, kernel_set):
    from functools import partial

    from ringllm.pipeline.ops.cpu import argmax_rows as argmax_of_set

    argmax_rows = partial(argmax_of_set, kernel_set=kernel_set)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(6, cols, generator=gen)
    x[1] = float("-inf")  # all equal: the first index
    x[2, cols // 2 :] = x[2].max() + 1  # ties: the first of them
    if cols > 3:
        x[3, 2] = float("nan")  # NaN wins, as in torch
        x[4, -1] = float("inf")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x[:, : max(1, cols - 1)]), x[:, : max(1, cols - 1)].argmax(-1))


# ---- the product of 16-bit weights (models/linear.py's ringllm16 layout) -----------------


def _packed(w: torch.Tensor, kernel_set: str):
    from ringllm.pipeline.models import linear
    from ringllm.pipeline.ops import cpu_kernels

    return linear._pack16(w.contiguous(), cpu_kernels.KERNEL_SETS.index(kernel_set))


@pytest.mark.parametrize("kernel_set", kernel_sets())
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k", [(96, 64), (100, 70), (7, 3), (960, 576)])
def test_linear16_matches_float32_products(kernel_set, wdtype, n, k):
    """Every tile shape (1..70 rows: whole row blocks, tails, wide and narrow tiles), columns
    that end mid-panel, odd K, with and without bias, against float64 products of the same
    widened weights."""
    from ringllm.pipeline.models import linear

    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) * 0.2).to(wdtype)
    bias = torch.randn(n, generator=gen)
    packed = _packed(w, kernel_set)
    for m in (1, 2, 3, 5, 6, 7, 8, 13, 48, 70):
        x = torch.randn(m, k, generator=gen)
        want = x.double() @ w.double().t()
        got = linear.linear(x, packed)
        assert got.shape == (m, n) and got.dtype == torch.float32
        tol = 1e-5 * (k**0.5)
        assert torch.allclose(got.double(), want, atol=tol, rtol=1e-5), (m, n, k)
        got_b = linear.linear(x, packed, bias)
        assert torch.allclose(got_b.double(), want + bias.double(), atol=tol, rtol=1e-5)


@pytest.mark.parametrize("kernel_set", kernel_sets())
def test_linear16_rows_do_not_depend_on_the_batch_or_threads(kernel_set, monkeypatch):
    """A row's product is the same bits alone, in any batch, strided, with 1 or 2 threads."""
    from ringllm.pipeline.models import linear

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(200, 96, generator=gen).to(torch.bfloat16)
    packed = _packed(w, kernel_set)
    x = torch.randn(70, 96, generator=gen)
    batched = linear.linear(x, packed)
    for r in (0, 5, 69):
        assert torch.equal(linear.linear(x[r : r + 1], packed), batched[r : r + 1])
    wide = torch.randn(70, 200, generator=gen)
    strided = wide[:, 50:146]  # rows 200 floats apart
    assert torch.equal(linear.linear(strided, packed), linear.linear(strided.contiguous(), packed))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert torch.equal(linear.linear(x, packed), batched)


def test_linear16_refuses_what_it_cannot_multiply():
    from ringllm.pipeline.models import linear

    packed = _packed(torch.randn(16, 8).to(torch.bfloat16), kernel_sets()[-1])
    with pytest.raises(ValueError, match="float32 CPU rows of 8"):
        linear.linear(torch.randn(2, 8, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="float32 CPU rows of 8"):
        linear.linear(torch.randn(2, 9), packed)
    with pytest.raises(ValueError, match="bias"):
        linear.linear(torch.randn(2, 8), packed, torch.randn(15))
    assert linear.linear(torch.randn(0, 8), packed).shape == (0, 16)
    assert linear.linear(torch.randn(3, 4, 8), packed).shape == (3, 4, 16)


# ---- LoRA --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7, 33, 80])  # 80: past LORA_C_MAX_TOKENS
@pytest.mark.parametrize("parts", [None, (10, 16, 12)])  # one part, or q | k | v
def test_lora_apply_matches_the_reference(ops, dtype, num_tokens, parts):
    """Per-token shrink and expand in one call against the grouped torch path: slots mixed
    with the base model's tokens (-1, rows left alone), y a column slice of a wider output
    (q of a fused qkv), y's columns in parts with their own B, a rank padded with zeros,
    sizes no vector width divides."""
    gen = torch.Generator().manual_seed(num_tokens)
    k, n, rank, num_slots = 70, 38, 12, 3
    width = rank * len(parts or (n,))
    x = torch.randn(num_tokens, k, generator=gen).to(dtype)
    wide = torch.randn(num_tokens, n + 9, generator=gen).to(dtype)
    a = (torch.randn(num_slots, width, k, generator=gen) / k**0.5).to(dtype)
    b = (torch.randn(num_slots, rank, n, generator=gen) / rank**0.5).to(dtype)
    b[1, 5:] = 0  # slot 1: rank 5 of 12
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen, dtype=torch.int32)
    got, want = wide.clone(), wide.clone()
    ops.lora_apply(got[:, 4 : 4 + n], x, a, b, slots, parts)
    TorchOps().lora_apply(want[:, 4 : 4 + n], x, a, b, slots, parts)
    if dtype == torch.float32:  # sums of order 1 in another order: absolute, not relative
        assert torch.allclose(got, want, rtol=1e-5, atol=2e-5)
    else:
        assert close_in_dtype(got, want, dtype)
    assert torch.equal(got[:, :4], wide[:, :4]) and torch.equal(got[:, 4 + n :], wide[:, 4 + n :])
    base_rows = slots < 0
    assert torch.equal(got[base_rows], wide[base_rows])
    if (~base_rows).any():
        assert not torch.equal(got[~base_rows], wide[~base_rows])


def test_lora_parts_take_their_own_columns_of_the_shrink():
    """Two parts: the second part's rows use the second rank block of a . x (a mistake
    there passes a one-part test)."""
    x = torch.zeros(1, 4)
    x[0, 0] = 1.0
    a = torch.zeros(1, 4, 4)  # P = 2 parts of rank 2
    a[0, 2, 0] = 3.0  # part 1, rank row 0: u[2] = 3
    b = torch.zeros(1, 2, 5)  # [S, R, out]
    b[0, 0, 3] = 2.0  # column 3 (part 1): 2 * u[2] = 6; part 0's columns see u[0:2] = 0
    for kernels in [*kernel_sets(), None]:
        y = torch.zeros(1, 5)
        ops = TorchOps() if kernels is None else CpuOps(kernels)
        ops.lora_apply(y, x, a, b, torch.zeros(1, dtype=torch.int32), (3, 2))
        assert y.tolist() == [[0.0, 0.0, 0.0, 6.0, 0.0]], kernels


def test_lora_apply_takes_the_torch_path_for_layouts_the_kernel_skips(ops):
    """int64 slots or a transposed x: the reference path, same result."""
    x = torch.randn(5, 16)
    a, b = torch.randn(2, 4, 16), torch.randn(2, 4, 8)
    slots = torch.tensor([0, 1, -1, 1, 0])
    got, want = torch.zeros(5, 8), torch.zeros(5, 8)
    ops.lora_apply(got, x.T.contiguous().T, a, b, slots.to(torch.int32))
    TorchOps().lora_apply(want, x, a, b, slots.to(torch.int32))
    assert torch.allclose(got, want, atol=1e-5)


# ---- Exp(1) draws (the sampler's exponential race) ---------------------------------------


def _draws(kernel_set: str, keys: list[int], cols: int, threads: int | None = None):
    from ringllm.pipeline.ops.cpu import exponential_rows

    out = torch.empty(len(keys), cols)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        exponential_rows(out, torch.tensor(keys, dtype=torch.int64), kernel_set)
    finally:
        torch.set_num_threads(before)
    return out


@pytest.mark.parametrize("kernel_set", kernel_sets())
def test_exponential_draws_are_exp1(kernel_set):
    """2^20 draws of 16 keys: the Kolmogorov-Smirnov distance to Exp(1) under its 0.1%
    critical value, mean and variance 1 within 5 standard errors, neighbouring draws (the
    two halves of one 64-bit value of the stream) uncorrelated, every draw finite and
    positive, and no two keys' rows alike."""
    x = _draws(kernel_set, [7 * i + 1 for i in range(16)], 65536).double()
    n = x.numel()
    assert torch.isfinite(x).all() and (x > 0).all() and x.max() < 23
    flat = x.flatten().sort().values
    cdf = 1 - torch.exp(-flat)
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    ks = torch.maximum(ranks / n - cdf, cdf - (ranks - 1) / n).max()
    assert ks < 1.95 / math.sqrt(n), ks
    assert abs(x.mean() - 1) < 5 / math.sqrt(n)
    assert abs(x.var() - 1) < 5 * math.sqrt(8 / n)  # Exp(1)'s fourth central moment is 9
    even, odd = x[:, 0::2].flatten(), x[:, 1::2].flatten()
    assert abs(torch.corrcoef(torch.stack([even, odd]))[0, 1]) < 5 / math.sqrt(n / 2)
    assert len({tuple(row[:4].tolist()) for row in x}) == 16


@pytest.mark.parametrize("kernel_set", kernel_sets())
def test_exponential_draws_depend_on_the_key_and_column_only(kernel_set):
    """A key's draws are the same bits in any row, batch, row length or thread count (the
    columns of a row are split among threads in chunks), and every kernel set draws the
    generic set's values to within their logarithm's rounding."""
    keys = [3, -5, 2**62 + 9, 3]
    wide = _draws(kernel_set, keys, 10_001)
    assert torch.equal(wide[0], wide[3])
    alone = _draws(kernel_set, [-5], 10_001, threads=1)
    assert torch.equal(alone[0], wide[1])
    assert torch.equal(_draws(kernel_set, [2**62 + 9], 37)[0], wide[2, :37])
    generic = _draws("generic", keys, 10_001)
    assert torch.allclose(wide, generic, rtol=1e-6, atol=0)
