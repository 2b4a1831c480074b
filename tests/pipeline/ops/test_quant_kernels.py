"""The quantized matrix kernels (pipeline/ops/quant.py) on every kernel set this CPU runs.

Oracles: gguf.quants.dequantize (bit-exact dequantization), a float64 product of the
dequantized weights (qlinear, within the activation quantization's bound), and the generic
set's result (every SIMD set, within float32 rounding). The AMX set's int8 weights run on
the tile unit in bfloat16: their oracle is the tile unit's arithmetic, emulated bit for bit
(`tile_unit_product`).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from ringllm.pipeline.ops import quant

SETS = quant.kernel_sets()
GGUF_TYPES = {name: t for t, name in quant.GGML_TYPES.items()}
# m = 1..4 take the GEMV path, 5 and up the tiled one; 17 and 64 leave partial row tiles.
ROW_COUNTS = (1, 2, 3, 4, 5, 8, 17, 64)


def gguf_blocks(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    """Valid blocks [n, row_bytes]: gguf's quantizer where it has one, else random bytes
    with finite fp16 scales (every bit pattern of the quants is a valid block)."""
    t = GGUF_TYPES[qtype]
    rng = np.random.default_rng(seed)
    try:
        return gguf_quantize(rng.standard_normal((n, k)).astype(np.float32), t)
    except NotImplementedError:
        pass
    block_k, block_bytes = gguf.GGML_QUANT_SIZES[t]
    blocks = rng.integers(0, 256, (n, k // block_k, block_bytes), dtype=np.uint8)
    halves = (rng.standard_normal((n, k // block_k, 2)) * 0.01).astype(np.float16)
    at = 208 if qtype == "q6_k" else 0  # d (and dmin) of the K-quants
    blocks[..., at : at + 2 * (1 if qtype == "q6_k" else 2)] = halves[
        ..., : 1 if qtype == "q6_k" else 2
    ].view(np.uint8)
    return blocks.reshape(n, -1)


def reference(qtype: str, blocks: np.ndarray, n: int, k: int) -> np.ndarray:
    return gguf_dequantize(blocks, GGUF_TYPES[qtype]).reshape(n, k)


def act_block(qtype: str) -> int:
    """k per activation scale: 256 for the K-quants (as llama.cpp's Q8_K), else 32."""
    return 256 if qtype.endswith("_k") else 32


def error_bounds(
    x: torch.Tensor, w: torch.Tensor, block: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """|y - x . w^T| allowed per element, as (activation part, float32 part). Each x differs
    from its int8 value q * da by at most da / 2 (da = max|x| / 127 of its block of 32, or
    256 for the K-quants), weighted by |w|. Float32 summation: G + 8 roundings (one per
    group and the scale products) of terms no larger than 32 max|w_row| sum|x| (the offsets
    M stretch a term to the range of the integers u)."""
    m, k = x.shape
    pad = -k % block
    xb = torch.nn.functional.pad(x.double().abs(), (0, pad)).view(m, -1, block)
    da = xb.amax(dim=2) / 127.0  # [m, blocks]
    wb = torch.nn.functional.pad(w.double().abs(), (0, pad)).view(w.shape[0], -1, block)
    act = (da / 2) @ wb.sum(dim=2).T  # [m, n]
    groups = (k + 31) // 32
    f32 = (groups + 8) * 2.0**-24 * 32 * (xb.sum(dim=(1, 2))[:, None] * wb.amax(dim=(1, 2)))
    return act, f32 * 1.01


def emulated(x: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
    """The product the kernels compute, in float64: each row quantized per block as they
    quantize it (float32 da = max|x| / 127, q = round-half-even(x * (127 / max|x|))), then
    sum_b da_b * (q_b . w_b). The kernels' integers are exact, so only float32 rounding of
    the scale products and sums may separate them from this."""
    m, k = x.shape
    pad = -k % block
    xb = torch.nn.functional.pad(x.float(), (0, pad)).view(m, -1, block).numpy()
    amax = np.abs(xb).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint((xb * inv).astype(np.float32)).astype(np.float64)
    da = (amax / np.float32(127.0)).astype(np.float32).astype(np.float64)
    wb = torch.nn.functional.pad(w.double(), (0, pad)).view(w.shape[0], -1, block).numpy()
    return torch.from_numpy(np.einsum("mbk,nbk->mn", q * da, wb))


def assert_within(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None, block=32) -> None:
    exact = x.double() @ w.double().T
    if bias is not None:
        exact += bias.double()
    err = (y.double() - exact).abs()
    act, f32 = error_bounds(x, w, block)
    bound = act + f32
    worst = (err / bound.clamp_min(1e-300)).max().item()
    assert worst <= 1.0, f"error {err.max().item():.3g} exceeds the bound ({worst:.2f}x)"
    # and the scheme itself: the same quantized activations, float32 rounding apart
    want = emulated(x, w, block) + (bias.double() if bias is not None else 0)
    assert ((y.double() - want).abs() <= f32).all(), (y.double() - want).abs().max()


@pytest.mark.parametrize("kernel_set", SETS)
@pytest.mark.parametrize("qtype", sorted(GGUF_TYPES))
def test_dequantize_is_bit_exact(qtype: str, kernel_set: str) -> None:
    block_k = gguf.GGML_QUANT_SIZES[GGUF_TYPES[qtype]][0]
    for n, k in ((1, block_k), (19, 3 * block_k), (8, 2 * block_k)):
        blocks = gguf_blocks(qtype, n, k, seed=n)
        qm = quant.pack_gguf(qtype, blocks, n, k, kernel_set)
        assert qm.shape == (n, k) and qm.kernel_set == kernel_set
        got = quant.dequantize(qm).numpy()
        np.testing.assert_array_equal(
            got.view(np.uint32), reference(qtype, blocks, n, k).view(np.uint32)
        )
    # a column shard, cut at block boundaries (the middle block of three), as a tensor
    blocks = gguf_blocks(qtype, 21, 3 * block_k, seed=7)
    row_bytes = blocks.shape[1] // 3
    shard = torch.from_numpy(blocks[:, row_bytes : 2 * row_bytes])
    qm = quant.pack_gguf(qtype, shard, 21, block_k, kernel_set)
    want = reference(qtype, blocks, 21, 3 * block_k)[:, block_k : 2 * block_k]
    np.testing.assert_array_equal(quant.dequantize(qm).numpy(), want)


@pytest.mark.parametrize("qtype", sorted(GGUF_TYPES))
def test_gguf_rows_dequantize_bit_exact(qtype: str) -> None:
    """An embedding's looked-up rows (models/quant_weights.py BlockEmbedding): any rows of
    the file's blocks, one at a time or many (the thread pool), equal to gguf's."""
    block_k = gguf.GGML_QUANT_SIZES[GGUF_TYPES[qtype]][0]
    k = 3 * block_k
    table = gguf_blocks(qtype, 40, k, seed=3)
    for ids in ([7], [39, 0, 7, 7], list(range(40))[::-1]):
        rows = np.ascontiguousarray(table[ids])
        got = quant.dequantize_gguf_rows(qtype, rows, k).numpy()
        want = reference(qtype, rows, len(ids), k)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert quant.dequantize_gguf_rows(qtype, table[:0], k).shape == (0, k)
    with pytest.raises(ValueError, match=f"k a positive multiple of {block_k}"):
        quant.dequantize_gguf_rows(qtype, table[:1], k + 1)
    with pytest.raises(ValueError, match="want shape"):
        quant.dequantize_gguf_rows(qtype, table[:2, :-1], k)


@pytest.mark.parametrize("kernel_set", SETS)
@pytest.mark.parametrize("qtype", sorted(GGUF_TYPES))
def test_qlinear_within_activation_bound(qtype: str, kernel_set: str) -> None:
    block_k = gguf.GGML_QUANT_SIZES[GGUF_TYPES[qtype]][0]
    n, k = 37, 512 if block_k == 256 else 96  # n: not a multiple of any panel height
    blocks = gguf_blocks(qtype, n, k, seed=3)
    w = torch.from_numpy(reference(qtype, blocks, n, k))
    qm = quant.pack_gguf(qtype, blocks, n, k, kernel_set)
    generic = quant.pack_gguf(qtype, blocks, n, k, "generic")
    gen = torch.Generator().manual_seed(0)
    for m in ROW_COUNTS:
        x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
        bias = torch.randn(n, generator=gen) if m == 5 else None
        y = quant.qlinear(x, qm, bias, threads=2)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert_within(y, x, w, bias, act_block(qtype))
        if kernel_set != "generic":
            # the same integers; only float32 rounding (summation order, fused adds) differs
            y_gen = quant.qlinear(x, generic, bias, threads=1)
            f32 = error_bounds(x, w, act_block(qtype))[1]
            assert ((y - y_gen).abs() <= 2 * f32).all(), (y - y_gen).abs().max()


def tile_unit_product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias=None):
    """The AMX set's i8 product (and its bf16 one: q the weights, scale 1), in float32 as
    the tile unit computes it: activations rounded to bfloat16 (to nearest even); per 32 k,
    a running sum of the even k's products and one of the odd k's, each rounded at every
    step, their sum added into C; then fl(fl(C * scale) + bias). (No denormals arise from these inputs: the unit flushes them.)"""
    xb = x.to(torch.bfloat16).float().numpy()
    w = q.float().numpy()
    m, k = xb.shape
    kp = -(-k // 32) * 32
    xb = np.pad(xb, ((0, 0), (0, kp - k)))
    w = np.pad(w, ((0, 0), (0, kp - k)))
    c = np.zeros((m, w.shape[0]), np.float32)
    for g in range(0, kp, 32):
        even = np.zeros_like(c)
        odd = np.zeros_like(c)
        for i in range(g, g + 32, 2):
            even = even + np.outer(xb[:, i], w[:, i])
            odd = odd + np.outer(xb[:, i + 1], w[:, i + 1])
        c = c + (even + odd)
    y = c * scale.numpy()[None, :]
    if bias is not None:
        y = y + bias.numpy()[None, :]
    return torch.from_numpy(y)


AMX_MIN_ROWS = quant._q.AMX_MIN_ROWS  # fewer rows run the VNNI set's integer kernels


@pytest.mark.skipif("avx512amx" not in SETS, reason="needs a CPU with AMX (amx-bf16)")
def test_int8_weights_on_the_tile_unit_bit_for_bit() -> None:
    """From AMX_MIN_ROWS rows on (partial panels and row tiles, k not a multiple of 32, a bias,
    bfloat16 and float32 activations, one thread and two): the bits of the emulated tile
    unit; below, the VNNI set's bits. Both within the int8 activation bound of the exact
    product (bfloat16 rounding is finer than int8 per 32)."""
    gen = torch.Generator().manual_seed(3)
    # (600, 70): many panels a thread, each block's rows written during the next block's
    for n, k in ((21, 80), (48, 256), (7, 32), (600, 70)):
        weight = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
        qm = quant.pack_int8(weight, "avx512amx")
        vnni = quant.pack_int8(weight, "avx512vnni")
        q, scale = quant.quantize_int8(weight)
        w = q.float() * scale[:, None]
        for m in (1, 5, AMX_MIN_ROWS - 1, AMX_MIN_ROWS, 31, 32, 33, 64, 100, 130):
            x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
            bias = torch.randn(n, generator=gen) if m % 2 else None
            tiles = m >= AMX_MIN_ROWS
            want = tile_unit_product(x, q, scale, bias) if tiles else quant.qlinear(x, vnni, bias)
            for threads in (1, 2):
                y = quant.qlinear(x, qm, bias, threads=threads)
                assert torch.equal(y, want), (n, k, m, (y - want).abs().max())
            exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
            act, f32 = error_bounds(x, w)
            assert ((y.double() - exact).abs() <= act + f32).all()
            if tiles:
                xb = x.to(torch.bfloat16)
                got = quant.qlinear(xb, qm, bias)
                assert torch.equal(got, tile_unit_product(xb, q, scale, bias))
                # a row's bits do not depend on the other rows of a step that takes tiles
                tail = m - AMX_MIN_ROWS
                assert torch.equal(quant.qlinear(xb[tail:], qm, bias), got[tail:])


@pytest.mark.skipif("avx512amx" not in SETS, reason="needs a CPU with AMX (amx-bf16)")
def test_the_tile_path_writes_bfloat16_as_torch_rounds_it() -> None:
    """A bf16 model's int8 products on the tile unit write bf16 straight away: the float32
    result rounded to nearest even, bit for bit; anywhere else bf16 out is refused."""
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(40, 96, generator=gen)
    qm = quant.pack_int8(weight, "avx512amx")
    bias = torch.randn(40, generator=gen)
    for m in (AMX_MIN_ROWS, 33, 70):
        x = (torch.randn(m, 96, generator=gen) * 3).to(torch.bfloat16)
        assert quant.writes_bf16(qm, m)
        out = torch.empty(m, 40, dtype=torch.bfloat16)
        assert quant.qlinear(x, qm, bias, out=out) is out
        assert torch.equal(out, quant.qlinear(x, qm, bias).to(torch.bfloat16))
    few = AMX_MIN_ROWS - 1
    x = torch.randn(few, 96, generator=gen).to(torch.bfloat16)
    assert not quant.writes_bf16(qm, few)
    with pytest.raises(ValueError, match="bfloat16 where writes_bf16"):
        quant.qlinear(x, qm, out=torch.empty(few, 40, dtype=torch.bfloat16))
    vnni = quant.pack_int8(weight, "avx512vnni")
    with pytest.raises(ValueError, match="bfloat16 where writes_bf16"):
        x40 = torch.randn(40, 96, generator=gen).to(torch.bfloat16)
        quant.qlinear(x40, vnni, out=torch.empty(40, 40, dtype=torch.bfloat16))


@pytest.mark.skipif("avx512amx" not in SETS, reason="needs a CPU with AMX (amx-bf16)")
def test_the_amx_set_is_the_vnni_set_for_gguf_blocks() -> None:
    """Only int8 weights move to the tile unit: every GGUF type packs, dequantizes and
    multiplies to the VNNI set's bits."""
    gen = torch.Generator().manual_seed(4)
    for qtype in sorted(GGUF_TYPES):
        k = 512 if act_block(qtype) == 256 else 96
        blocks = gguf_blocks(qtype, 37, k, seed=5)
        amx, vnni = (quant.pack_gguf(qtype, blocks, 37, k, s) for s in ("avx512amx", "avx512vnni"))
        assert torch.equal(amx.data, vnni.data)
        for m in (1, 5, 33):
            x = torch.randn(m, k, generator=gen)
            assert torch.equal(quant.qlinear(x, amx), quant.qlinear(x, vnni))


@pytest.mark.parametrize("kernel_set", SETS)
def test_int8_weights(kernel_set: str) -> None:
    gen = torch.Generator().manual_seed(1)
    n, k = 21, 80  # k not a multiple of 32: the last group is padded with zeros
    weight = torch.randn(n, k, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    weight[3] = 0  # an all-zero row: scale 0, no division by it
    qm = quant.pack_int8(weight, kernel_set)
    q, scale = quant.quantize_int8(weight)
    assert q.abs().max().item() <= 127 and scale[3].item() == 0
    w = q.float() * scale[:, None]
    assert torch.equal(quant.dequantize(qm), w)
    assert (w - weight.float()).abs().max().item() <= scale.max().item() / 2 * (1 + 1e-6)
    for m in ROW_COUNTS:
        x = torch.randn(m, k, generator=gen)
        y = quant.qlinear(x, qm, threads=2)
        if kernel_set == "avx512amx" and m >= AMX_MIN_ROWS:  # rounded to bf16, not int8
            assert torch.equal(y, tile_unit_product(x, q, scale))
        else:
            assert_within(y, x, w)
    # bfloat16 activations are widened exactly
    xb = torch.randn(6, k, generator=gen).to(torch.bfloat16)
    torch.testing.assert_close(quant.qlinear(xb, qm), quant.qlinear(xb.float(), qm), rtol=0, atol=0)


def test_strided_rows_and_out() -> None:
    blocks = gguf_blocks("q8_0", 16, 64, seed=5)
    qm = quant.pack_gguf("q8_0", blocks, 16, 64)
    base = torch.randn(3, 100)
    x = base[:, 10:74]  # rows 100 apart, contiguous within
    out = torch.empty(3, 16)
    assert quant.qlinear(x, qm, out=out) is out
    torch.testing.assert_close(out, quant.qlinear(x.contiguous(), qm), rtol=0, atol=0)


def test_bad_inputs_are_value_errors() -> None:
    blocks = gguf_blocks("q4_0", 4, 64, seed=0)
    with pytest.raises(ValueError, match=r"want shape \(4, 36\).*got \(4, 35\)"):
        quant.pack_gguf("q4_0", blocks[:, :35], 4, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.pack_gguf("q4_0", blocks, 4, 48)
    with pytest.raises(ValueError, match="multiple of 256"):
        quant.pack_gguf("q4_k", np.zeros((2, 144), np.uint8), 2, 128)
    with pytest.raises(ValueError, match="uint8"):
        quant.pack_gguf("q4_0", blocks.astype(np.int16), 4, 64)
    with pytest.raises(ValueError, match="kernels take q4_0"):
        quant.pack_gguf("q3_k", blocks, 4, 64)
    with pytest.raises(ValueError, match="this CPU runs"):
        quant.pack_gguf("q4_0", blocks, 4, 64, kernel_set="neon")
    qm = quant.pack_gguf("q4_0", blocks, 4, 64)
    with pytest.raises(ValueError, match="contiguous"):
        quant.qlinear(torch.randn(64, 3).T, qm)
    with pytest.raises(ValueError, match="float32 / bfloat16"):
        quant.qlinear(torch.randn(3, 64, dtype=torch.float64), qm)
    with pytest.raises(ValueError, match="x has 63 columns"):
        quant.qlinear(torch.randn(3, 63), qm)
    with pytest.raises(ValueError, match="bias"):
        quant.qlinear(torch.randn(3, 64), qm, bias=torch.randn(5))
    with pytest.raises(ValueError, match="out"):
        quant.qlinear(torch.randn(3, 64), qm, out=torch.empty(3, 5))
    with pytest.raises(ValueError, match="2-D float32"):
        quant.pack_int8(torch.randn(4, 4, dtype=torch.float64))


def test_default_kernel_set_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(quant.ENV_KERNELS, "generic")
    assert quant.default_kernel_set() == "generic"
    monkeypatch.setenv(quant.ENV_KERNELS, "sve")
    with pytest.raises(ValueError, match="RINGLLM_QUANT_KERNELS='sve'.*generic"):
        quant.default_kernel_set()
    monkeypatch.delenv(quant.ENV_KERNELS)
    assert quant.default_kernel_set() == SETS[-1]


def test_packed_size_stays_near_gguf() -> None:
    """Decode streams the packed bytes every token: within 3% of GGUF's (n a whole panel)."""
    for qtype, t in GGUF_TYPES.items():
        block_k, block_bytes = gguf.GGML_QUANT_SIZES[t]
        n, k = 32, 2 * 256
        qm = quant.pack_gguf(qtype, gguf_blocks(qtype, n, k, seed=2), n, k)
        assert qm.nbytes <= n * k // block_k * block_bytes * 1.03, qtype


@pytest.mark.skipif("avx512amx" not in SETS, reason="needs a CPU with AMX (amx-bf16)")
def test_bf16_weights_on_the_tile_unit_bit_for_bit() -> None:
    """bfloat16 weights laid out as tiles (a bf16 checkpoint's matrices under float32
    activations): at every row count, from one, the emulated tile unit's bits (the i8
    emulation with the weights' own values and a scale of 1, which is exact), for one
    thread and two, float32 and bfloat16 activations; a row's bits do not depend on the
    rest of its batch; `dequantize` gives the weights back; bfloat16 out is the float32
    result rounded."""
    gen = torch.Generator().manual_seed(8)
    for n, k in ((21, 80), (48, 256), (7, 32), (600, 70), (40, 1)):
        weight = (torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)).bfloat16()
        qm = quant.pack_bf16(weight)
        assert qm.qtype == "bf16" and qm.kernel_set == "avx512amx"
        assert qm.nbytes == -(-n // 16) * -(-k // 32) * 1024  # a 1 KB tile per 16 rows x 32 k
        assert torch.equal(quant.dequantize(qm), weight.float())
        ones = torch.ones(n)
        for m in (1, 2, 5, 16, 17, 33, 64, 65, 100, 130):
            x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
            bias = torch.randn(n, generator=gen) if m % 2 else None
            want = tile_unit_product(x, weight.float(), ones, bias)
            for threads in (1, 2):
                assert torch.equal(quant.qlinear(x, qm, bias, threads=threads), want), (n, k, m)
            for i in (0, m - 1):
                assert torch.equal(quant.qlinear(x[i : i + 1], qm, bias)[0], want[i])
            exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
            # activations rounded to bf16 (2^-9 relative), float32 sums of k terms
            bound = (x.double().abs() @ weight.double().abs().T) * (2**-8 + k * 2**-23) + 1e-30
            assert ((want.double() - exact).abs() <= bound).all()
            xb = x.to(torch.bfloat16)
            assert torch.equal(quant.qlinear(xb, qm, bias), want)  # already rounded: the same
            assert quant.writes_bf16(qm, m)
            out = torch.empty(m, n, dtype=torch.bfloat16)
            assert torch.equal(quant.qlinear(xb, qm, bias, out=out), want.to(torch.bfloat16))


@pytest.mark.skipif("avx512bf16" not in SETS, reason="needs a CPU with AVX512_BF16")
def test_bf16_weights_on_vdpbf16ps() -> None:
    """bfloat16 weights on a CPU with AVX512_BF16 (the avx512bf16 set; Zen 4 / 5 have no
    tile unit): the tile unit's layout, each activation rounded to bfloat16, float32 sums.
    Within the rounding's bound of the exact product at every row count, from one, and a
    row's bits the same alone, in any batch and with one thread or two (two chains per row
    in one order, whatever the rows around it); `dequantize` gives the weights back;
    bfloat16 activations are the same product; bfloat16 out is the float32 result rounded;
    the set's other types are the VNNI set's, bit for bit."""
    gen = torch.Generator().manual_seed(9)
    for n, k in ((21, 80), (48, 256), (7, 32), (600, 70), (40, 1), (64, 1536)):
        weight = (torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)).bfloat16()
        qm = quant.pack_bf16(weight, "avx512bf16")
        assert qm.qtype == "bf16" and qm.kernel_set == "avx512bf16"
        assert qm.nbytes == -(-n // 16) * -(-k // 32) * 1024
        assert torch.equal(quant.dequantize(qm), weight.float())
        for m in (1, 2, 5, 12, 13, 16, 17, 33, 64, 100):
            x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
            bias = torch.randn(n, generator=gen) if m % 2 else None
            got = quant.qlinear(x, qm, bias, threads=1)
            assert torch.equal(quant.qlinear(x, qm, bias, threads=2), got), (n, k, m)
            if n < 64:  # five threads over at most four panels: some take none
                assert torch.equal(quant.qlinear(x, qm, bias, threads=5), got), (n, k, m)
            for i in (0, m // 2, m - 1):
                assert torch.equal(quant.qlinear(x[i : i + 1], qm, bias)[0], got[i]), (n, k, m)
            xb = x.to(torch.bfloat16)
            exact = xb.double() @ weight.double().T + (0 if bias is None else bias.double())
            # the activations' rounding (2^-9 relative) is in `exact`; float32 sums of k terms
            bound = (xb.double().abs() @ weight.double().abs().T) * (k * 2**-23) + 1e-30
            bound = bound + (0 if bias is None else bias.double().abs() * 2**-23)
            assert ((got.double() - exact).abs() <= bound).all(), (n, k, m)
            assert torch.equal(quant.qlinear(xb, qm, bias), got)
            assert quant.writes_bf16(qm, m)
            out = torch.empty(m, n, dtype=torch.bfloat16)
            assert torch.equal(quant.qlinear(xb, qm, bias, out=out), got.to(torch.bfloat16))
    for qtype in ("q4_k", "q8_0"):
        blocks = gguf_blocks(qtype, 37, 512, seed=5)
        a, b = (quant.pack_gguf(qtype, blocks, 37, 512, s) for s in ("avx512bf16", "avx512vnni"))
        x = torch.randn(9, 512, generator=gen)
        assert torch.equal(quant.qlinear(x, a), quant.qlinear(x, b))


def test_bf16_weights_are_the_bf16_sets_only() -> None:
    """Every other set, and a weight that is not 2-D bfloat16, is a clear error."""
    weight = torch.randn(8, 64).bfloat16()
    for kernel_set in SETS:
        if kernel_set not in quant.BF16_SETS:
            with pytest.raises(ValueError, match="bf16 weights are the avx512bf16 and avx512amx"):
                quant.pack_bf16(weight, kernel_set)
    with pytest.raises(ValueError, match="2-D bfloat16"):
        quant.pack_bf16(weight.float())
    with pytest.raises(ValueError, match="use pack_int8 / pack_bf16"):
        quant.pack_gguf("bf16", np.zeros((8, 128), np.uint8), 8, 64)
    qt = quant.QUANT_TYPES.index("bf16")
    with pytest.raises(ValueError, match="avx512bf16 and avx512amx sets' only"):
        quant._q.pack(0, 1, qt, 0, 0, 0, 8, 64)  # the C module checks it too
    assert quant.bf16_tiles_available() == (quant.default_kernel_set() in quant.BF16_SETS)


@pytest.mark.parametrize("kernel_set", SETS)
@pytest.mark.parametrize("qtype", [t for t in quant.QUANT_TYPES if t != "bf16"])
def test_rows_do_not_depend_on_the_batch(qtype: str, kernel_set: str) -> None:
    """Each row is quantized and summed in the same order on either path (GEMV, decoding
    in registers; tiled) and in any row tile, so a row's output is bit for bit the same
    alone or in a batch, for every type's decoding. (The AMX set's int8 weights from
    AMX_MIN_ROWS rows on: test_int8_weights_on_the_tile_unit_bit_for_bit.)"""
    gen = torch.Generator().manual_seed(2)
    n, k = 40, 112 if qtype == "i8" else 512  # i8: a last group padded with zeros
    if qtype == "i8":
        qm = quant.pack_int8(torch.randn(n, k, generator=gen), kernel_set)
    else:
        qm = quant.pack_gguf(qtype, gguf_blocks(qtype, n, k, seed=4), n, k, kernel_set)
    tiles = kernel_set == "avx512amx" and qtype == "i8"
    x = torch.randn(AMX_MIN_ROWS - 1 if tiles else 19, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    batch = quant.qlinear(x, qm, bias, threads=2)
    for threads in (3, 5):  # each thread its share of the 3 panels, some with none
        assert torch.equal(quant.qlinear(x, qm, bias, threads=threads), batch)
    for i in (0, 5, len(x) - 1):
        assert torch.equal(quant.qlinear(x[i : i + 1], qm, bias, threads=1)[0], batch[i])
    for m in (2, 3, 4):
        assert torch.equal(quant.qlinear(x[:m], qm, bias), batch[:m])
