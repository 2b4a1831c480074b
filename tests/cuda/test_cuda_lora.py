"""The LoRA kernels (cuda/lora.cu) in the CPU emulator against TorchOps.lora_apply, in both
thread orders and all dtypes: tokens of several adapters and of none in one call, y and x
as column slices of wider tensors, a y whose columns are strided (the copy path), slots
outside the stack, and the arguments CudaOps refuses.

Shapes are small (3 slots of rank 8, slot 1's adapter of rank 5 padded with zeros,
in = 70 and out = 38: neither a multiple of a warp nor of the 4 rank rows a shrink CTA
takes) so the file runs in seconds through the emulator. The conftest TOLERANCES hold
unchanged for 16-bit: the kernels keep the shrunk rows in float32 and round y + delta once,
as the reference does, so the two differ only by float32 summation order inside a dot
product (a last-place flip at worst).
"""

from __future__ import annotations

import pytest
import torch

from ringllm.cuda.ops import CudaOps

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NUM_SLOTS, RANK, PADDED_RANK, IN_FEATURES, OUT_FEATURES = 3, 8, 5, 70, 38
# Slot 1 (the padded adapter) alone for one token; then -1 and every slot, out of order.
SLOTS = (1, -1, 0, 2, 2, -1, 1, 0, 0, 2, -1, 1, 2)


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(dtype)


def _adapters(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """a_stack [S, R, in], b_stack [S, R, out], scaled so the delta is of order 1; slot 1's
    rank padded from 5 to 8 with zero rows of a and of b, as loading pads it."""
    a_stack = _randn(NUM_SLOTS, RANK, IN_FEATURES, dtype=dtype, seed=seed, scale=IN_FEATURES**-0.5)
    b_stack = _randn(NUM_SLOTS, RANK, OUT_FEATURES, dtype=dtype, seed=seed + 1, scale=RANK**-0.5)
    a_stack[1, PADDED_RANK:] = 0
    b_stack[1, PADDED_RANK:] = 0
    return a_stack, b_stack


def _slots(num_tokens: int) -> torch.Tensor:
    return torch.tensor(SLOTS[:num_tokens], dtype=torch.int32)


def _inputs(dtype: torch.dtype, num_tokens: int, seed: int, sliced: bool):
    """(y, x, y's wider tensor or None): with sliced, y and x are column slices of wider
    rows (y: a middle block of a fused output; x: rows further apart than their length)."""
    x = _randn(num_tokens, IN_FEATURES + 3, dtype=dtype, seed=seed)
    x = x[:, 3:] if sliced else x[:, :IN_FEATURES].contiguous()
    if not sliced:
        return _randn(num_tokens, OUT_FEATURES, dtype=dtype, seed=seed + 1), x, None
    wide = _randn(num_tokens, OUT_FEATURES + 20, dtype=dtype, seed=seed + 1)
    return wide[:, 10 : 10 + OUT_FEATURES], x, wide


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 5, 13])
@pytest.mark.parametrize("sliced", [False, True], ids=["contiguous", "sliced"])
def test_lora_apply_matches_reference(
    emulated_ops, reference_ops, assert_close, dtype, num_tokens, sliced
):
    y, x, wide = _inputs(dtype, num_tokens, seed=num_tokens, sliced=sliced)
    a_stack, b_stack = _adapters(dtype, seed=10)
    slots = _slots(num_tokens)
    before, wide_before = y.clone(), None if wide is None else wide.clone()
    expected = y.clone()
    reference_ops.lora_apply(expected, x, a_stack, b_stack, slots)
    emulated_ops.lora_apply(y, x, a_stack, b_stack, slots)
    assert_close(y, expected)
    assert torch.equal(y[slots < 0], before[slots < 0])  # tokens without an adapter
    if wide is not None:  # the columns around the slice are not written
        around = torch.ones(wide.shape[1], dtype=torch.bool)
        around[10 : 10 + OUT_FEATURES] = False
        assert torch.equal(wide[:, around], wide_before[:, around])


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_token_on_one_adapter(emulated_ops, reference_ops, assert_close, dtype):
    """The reference's one-slot path (no row gathering), against the same kernels."""
    y, x, _ = _inputs(dtype, 7, seed=20, sliced=False)
    a_stack, b_stack = _adapters(dtype, seed=21)
    slots = torch.full((7,), 2, dtype=torch.int32)
    expected = y.clone()
    reference_ops.lora_apply(expected, x, a_stack, b_stack, slots)
    emulated_ops.lora_apply(y, x, a_stack, b_stack, slots)
    assert_close(y, expected)


def _exact_case(dtype, x_row, a_rows, b_row, y_value):
    """One token on slot 0, one output column, exact in float32: (y, x, a, b, slots)."""
    y, x = torch.tensor([[y_value]], dtype=dtype), torch.tensor([x_row], dtype=dtype)
    a_stack = torch.tensor([a_rows], dtype=dtype)
    b_stack = torch.tensor([[b_row]], dtype=dtype).transpose(1, 2).contiguous()  # [1, R, 1]
    return y, x, a_stack, b_stack, torch.zeros(1, dtype=torch.int32)


SIXTEEN_BIT = (torch.float16, torch.bfloat16)


@pytest.mark.parametrize("dtype", SIXTEEN_BIT)
def test_the_shrunk_row_stays_float32(emulated_ops, reference_ops, dtype):
    """t = a . x = [1 + 2**-12, 1], which 16-bit would round to [1, 1]; b = [4096, -4096]
    then gives a delta of 1 from float32 t and 0 from a rounded one."""
    y, *args = _exact_case(dtype, [1, 2**-12], [[1, 1], [1, 0]], [4096, -4096], 0)
    expected = y.clone()
    reference_ops.lora_apply(expected, *args)
    emulated_ops.lora_apply(y, *args)
    assert y.item() == expected.item() == 1


@pytest.mark.parametrize("dtype", SIXTEEN_BIT)
def test_y_plus_delta_is_rounded_once(emulated_ops, reference_ops, dtype):
    """y = 2**p and delta = 1 + 2**-p (p: the dtype's significand bits; a spacing of 2 at y):
    y + delta rounds up to y + 2, where rounding delta to 1 first would tie back down to y."""
    p = {torch.float16: 11, torch.bfloat16: 8}[dtype]
    y, *args = _exact_case(dtype, [1, 2**-p], [[1, 1], [0, 0]], [1, 0], 2**p)
    expected = y.clone()
    reference_ops.lora_apply(expected, *args)
    emulated_ops.lora_apply(y, *args)
    assert y.item() == expected.item() == 2**p + 2


def test_a_y_with_strided_columns_goes_through_a_copy(emulated_ops, reference_ops, assert_close):
    """y [T, out] as the transpose of an [out, T] tensor: written back in place all the same."""
    _, x, _ = _inputs(torch.float32, 5, seed=30, sliced=False)
    y = _randn(OUT_FEATURES, 5, dtype=torch.float32, seed=31).t()
    a_stack, b_stack = _adapters(torch.float32, seed=32)
    slots = _slots(5)
    expected = y.clone()
    reference_ops.lora_apply(expected, x, a_stack, b_stack, slots)
    emulated_ops.lora_apply(y, x, a_stack, b_stack, slots)
    assert y.stride(1) != 1
    assert_close(y, expected)


def test_a_slot_outside_the_stack_adds_nothing(emulated_ops):
    """The kernels never read out of bounds: a token naming slot S is left as slot -1 leaves it."""
    y, x, _ = _inputs(torch.float32, 6, seed=40, sliced=False)
    a_stack, b_stack = _adapters(torch.float32, seed=41)
    slots = _slots(6)
    bad, none = slots.clone(), slots.clone()
    bad[2], none[2] = NUM_SLOTS, -1
    expected = y.clone()
    emulated_ops.lora_apply(expected, x, a_stack, b_stack, none)
    emulated_ops.lora_apply(y, x, a_stack, b_stack, bad)
    assert torch.equal(y, expected)


def test_the_same_bits_in_both_thread_orders_and_on_a_repeat():
    y, x, _ = _inputs(torch.bfloat16, 9, seed=50, sliced=False)
    args = (x, *_adapters(torch.bfloat16, seed=51), _slots(9))
    forward = CudaOps(backend="emulator", thread_order="forward")
    reverse = CudaOps(backend="emulator", thread_order="reverse")
    first = y.clone()
    forward.lora_apply(first, *args)
    for ops in (forward, reverse):
        again = y.clone()
        ops.lora_apply(again, *args)
        assert torch.equal(again, first)


def test_no_tokens_are_a_no_op(emulated_ops):
    y, x = torch.empty(0, OUT_FEATURES), torch.empty(0, IN_FEATURES)
    emulated_ops.lora_apply(
        y, x, *_adapters(torch.float32, seed=60), torch.empty(0, dtype=torch.int32)
    )
    assert y.shape == (0, OUT_FEATURES)


def _bad_inputs():
    """(name, a change to the good arguments, the message's start)."""
    return [
        ("int64 slots", {"token_slots": lambda a: a["token_slots"].long()}, "token_slots must be"),
        ("fewer slots", {"token_slots": lambda a: a["token_slots"][1:]}, "token_slots must be"),
        ("fewer y rows", {"y": lambda a: a["y"][1:]}, "y must be"),
        ("3-D x", {"x": lambda a: a["x"][None]}, "x must be"),
        ("short a rows", {"a_stack": lambda a: a["a_stack"][:, :, 1:]}, "a_stack must be"),
        ("b of another rank", {"b_stack": lambda a: a["b_stack"][:, 1:]}, "b_stack must be"),
        ("b of fewer slots", {"b_stack": lambda a: a["b_stack"][1:]}, "b_stack must be"),
        ("float32 b", {"b_stack": lambda a: a["b_stack"].float()}, "b_stack must have"),
        ("float32 y", {"y": lambda a: a["y"].float()}, "y must have"),
        (
            "strided a",
            {"a_stack": lambda a: a["a_stack"].transpose(1, 2).contiguous().transpose(1, 2)},
            "a_stack must be contiguous",
        ),
        ("float64 x", {"x": lambda a: a["x"].double()}, "CudaOps supports"),
    ]


@pytest.mark.parametrize(("change", "message"), [c[1:] for c in _bad_inputs()],
                         ids=[c[0] for c in _bad_inputs()])  # fmt: skip
def test_bad_arguments_are_refused(emulated_ops, change, message):
    y, x, _ = _inputs(torch.float16, 4, seed=70, sliced=False)
    a_stack, b_stack = _adapters(torch.float16, seed=71)
    args = {"y": y, "x": x, "a_stack": a_stack, "b_stack": b_stack, "token_slots": _slots(4)}
    args.update({name: make(args) for name, make in change.items()})
    with pytest.raises(ValueError, match=message):
        emulated_ops.lora_apply(**args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts", [(10, 16, 12), (19, 19)], ids=["qkv", "gate_up"])
def test_fused_parts_take_their_own_rank_block(
    emulated_ops, reference_ops, assert_close, dtype, parts
):
    """y's columns in parts (q | k | v, gate | up), each part's rows reading its own block of
    the shrunk row: a_stack [S, P * R, in] against b_stack [S, R, out]."""
    num_tokens, width = 7, len(parts) * RANK
    y, x, _ = _inputs(dtype, num_tokens, seed=3, sliced=False)
    a_stack = _randn(NUM_SLOTS, width, IN_FEATURES, dtype=dtype, seed=4, scale=IN_FEATURES**-0.5)
    b_stack = _randn(NUM_SLOTS, RANK, OUT_FEATURES, dtype=dtype, seed=5, scale=RANK**-0.5)
    slots = _slots(num_tokens)
    expected = y.clone()
    reference_ops.lora_apply(expected, x, a_stack, b_stack, slots, parts)
    emulated_ops.lora_apply(y, x, a_stack, b_stack, slots, parts)
    assert_close(y, expected)
    one_part = y.clone()
    reference_ops.lora_apply(one_part, x, a_stack[:, :RANK].contiguous(), b_stack, slots)
    assert not torch.equal(one_part, expected)  # the parts matter: the check has teeth


def test_parts_that_do_not_fit_are_refused():
    ops = CudaOps.__new__(CudaOps)
    x, y = torch.zeros(2, IN_FEATURES), torch.zeros(2, OUT_FEATURES)
    a, b = torch.zeros(1, 2 * RANK, IN_FEATURES), torch.zeros(1, RANK, OUT_FEATURES)
    slots = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="parts"):
        ops.lora_apply(y, x, a, b, slots, (10, 10))  # do not sum to out
    with pytest.raises(ValueError, match="b_stack must be"):
        ops.lora_apply(y, x, a, b, slots, (10, 10, 18))  # 16 rows over 3 parts
