"""The mixture-of-experts kernels (cuda/moe.cu) in the CPU emulator against TorchOps'
loop over the experts, in both thread orders and all dtypes; their grouping against torch's
stable sort; and MoeWeights.forward taking them on CudaOps.

Shapes are small (8 experts, 2 per token, H = 70 and I = 38: neither a multiple of a warp
nor of the 4 columns a CTA takes, so the last CTA of each product has idle warps)
so the file runs in seconds through the emulator. The conftest TOLERANCES hold unchanged
for 16-bit: the kernels round gate and up, act(gate), act * up, y and each weighted slot
where the reference rounds them, so the two differ only by float32 summation order inside
a dot product (a last-place flip at worst, carried through the down product).
"""

from __future__ import annotations

import pytest
import torch

from ringllm.cuda.ops import CudaOps
from ringllm.pipeline.models.moe import MoeWeights
from ringllm.pipeline.ops import TorchOps

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 8, 2, 70, 38


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(dtype)


def _experts(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w_gate_up [E, 2I, H], w_down [E, H, I], scaled so every product is of order 1."""
    w_gate_up = _randn(
        NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, dtype=dtype, seed=seed, scale=HIDDEN**-0.5
    )
    w_down = _randn(
        NUM_EXPERTS, HIDDEN, INTERMEDIATE, dtype=dtype, seed=seed + 1, scale=INTERMEDIATE**-0.5
    )
    return w_gate_up, w_down


def _route(h: torch.Tensor, seed: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in h's dtype, experts [T, k] int64), as MoeWeights.route makes them."""
    router = _randn(NUM_EXPERTS, HIDDEN, dtype=h.dtype, seed=seed)
    probs = torch.softmax(h @ router.T, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, TOP_K, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(h.dtype), experts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 17])  # 3 tokens: at most 6 of the 8 experts
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_moe_experts_match_reference(
    emulated_ops, reference_ops, assert_close, dtype, num_tokens, renormalize, activation
):
    h = _randn(num_tokens, HIDDEN, dtype=dtype, seed=num_tokens)
    weights, experts = _route(h, seed=10, renormalize=renormalize)
    w_gate_up, w_down = _experts(dtype, seed=20)
    if num_tokens == 3:
        assert (torch.bincount(experts.reshape(-1), minlength=NUM_EXPERTS) == 0).any()
    args = (h, weights, experts, w_gate_up, w_down, activation)
    assert_close(emulated_ops.moe_experts(*args), reference_ops.moe_experts(*args))


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_expert_taking_every_token(emulated_ops, reference_ops, assert_close, dtype):
    """Expert 5 in every token's slot 0 or 1 (alternating), the other slot random: one run
    of 12 rows, and slots whose sorted positions are out of slot order."""
    h = _randn(12, HIDDEN, dtype=dtype, seed=30)
    weights, _ = _route(h, seed=31, renormalize=True)
    others = torch.tensor([0, 1, 2, 3, 4, 6, 7, 0, 1, 2, 3, 4])
    experts = torch.stack([torch.full((12,), 5), others], dim=1)
    experts[1::2] = experts[1::2].flip(1)
    w_gate_up, w_down = _experts(dtype, seed=32)
    args = (h, weights, experts, w_gate_up, w_down)
    assert_close(emulated_ops.moe_experts(*args), reference_ops.moe_experts(*args))


def test_grouping_is_torch_stable_sort(emulated_ops):
    """600 pairs over at most 256 segments (several pairs per thread), 8 experts, one unused."""
    generator = torch.Generator().manual_seed(40)
    experts = torch.randint(0, NUM_EXPERTS - 1, (300, TOP_K), generator=generator)
    counts, offsets, sorted_pairs, pair_positions = emulated_ops.moe_group(experts, NUM_EXPERTS)
    flat = experts.reshape(-1)
    expected_counts = torch.bincount(flat, minlength=NUM_EXPERTS)
    assert torch.equal(counts.long(), expected_counts)
    assert offsets.tolist() == [0, *expected_counts.cumsum(0).tolist()]
    order = torch.argsort(flat, stable=True)
    assert torch.equal(sorted_pairs.long(), order)
    assert torch.equal(pair_positions.long()[order], torch.arange(flat.numel()))


def test_an_expert_id_out_of_range_adds_nothing(emulated_ops):
    """The kernels never read out of bounds: a slot naming expert -1 or E contributes
    nothing, exactly as a slot of weight 0 would."""
    h = _randn(4, HIDDEN, dtype=torch.float32, seed=50)
    weights, experts = _route(h, seed=51, renormalize=False)
    w_gate_up, w_down = _experts(torch.float32, seed=52)
    bad = experts.clone()
    bad[0, 1], bad[2, 0] = -1, NUM_EXPERTS
    zeroed = weights.clone()
    zeroed[0, 1] = zeroed[2, 0] = 0
    _, _, sorted_pairs, pair_positions = emulated_ops.moe_group(bad, NUM_EXPERTS)
    assert pair_positions[1] == -1 and pair_positions[4] == -1
    assert sorted_pairs[-2:].tolist() == [-1, -1]
    expected = emulated_ops.moe_experts(h, zeroed, experts, w_gate_up, w_down)
    assert torch.equal(emulated_ops.moe_experts(h, weights, bad, w_gate_up, w_down), expected)


def test_the_same_bits_in_both_thread_orders_and_on_a_repeat():
    h = _randn(9, HIDDEN, dtype=torch.bfloat16, seed=60)
    weights, experts = _route(h, seed=61, renormalize=True)
    args = (h, weights, experts, *_experts(torch.bfloat16, seed=62))
    forward = CudaOps(backend="emulator", thread_order="forward")
    reverse = CudaOps(backend="emulator", thread_order="reverse")
    first = forward.moe_experts(*args)
    assert torch.equal(forward.moe_experts(*args), first)
    assert torch.equal(reverse.moe_experts(*args), first)


def test_no_tokens_give_an_empty_output(emulated_ops):
    h = torch.empty(0, HIDDEN)
    weights, experts = torch.empty(0, TOP_K), torch.empty(0, TOP_K, dtype=torch.int64)
    out = emulated_ops.moe_experts(h, weights, experts, *_experts(torch.float32, seed=70))
    assert out.shape == (0, HIDDEN) and out.dtype == torch.float32


def _bad_inputs():
    """(name, a change to the good arguments, the message's start)."""
    return [
        ("3-D h", {"h": lambda a: a["h"][None]}, "h must be"),
        ("int32 experts", {"experts": lambda a: a["experts"].int()}, "experts must be int64"),
        ("fewer weights", {"weights": lambda a: a["weights"][:, :1]}, "weights must be"),
        ("float32 weights", {"weights": lambda a: a["weights"].float()}, "weights must have"),
        ("odd gate_up", {"w_gate_up": lambda a: a["w_gate_up"][:, 1:]}, "w_gate_up must be"),
        ("wrong down", {"w_down": lambda a: a["w_down"][:, :, 1:]}, "w_down must be"),
        ("float32 down", {"w_down": lambda a: a["w_down"].float()}, "w_down must have"),
        (
            "strided down",
            {"w_down": lambda a: a["w_down"].transpose(1, 2).contiguous().transpose(1, 2)},
            "w_down must be contiguous",
        ),
        ("relu", {"activation": lambda a: "relu"}, "activation must be one of"),
        ("float64 h", {"h": lambda a: a["h"].double()}, "CudaOps supports"),
    ]


@pytest.mark.parametrize(("change", "message"), [c[1:] for c in _bad_inputs()],
                         ids=[c[0] for c in _bad_inputs()])  # fmt: skip
def test_bad_arguments_are_refused(emulated_ops, change, message):
    h = _randn(3, HIDDEN, dtype=torch.float16, seed=80)
    weights, experts = _route(h, seed=81, renormalize=False)
    w_gate_up, w_down = _experts(torch.float16, seed=82)
    args = {"h": h, "weights": weights, "experts": experts, "w_gate_up": w_gate_up,
            "w_down": w_down, "activation": "silu"}  # fmt: skip
    args.update({name: make(args) for name, make in change.items()})
    with pytest.raises(ValueError, match=message):
        emulated_ops.moe_experts(**args)


# ---- the model's sparse MLP ----


def _moe_layer(dtype: torch.dtype, seed: int) -> MoeWeights:
    """A sparse layer of small random dense experts, each its own tensor as loading makes them."""
    w_gate_up, w_down = _experts(dtype, seed)
    router = _randn(NUM_EXPERTS, HIDDEN, dtype=dtype, seed=seed + 2)
    return MoeWeights(
        router, [w.clone() for w in w_gate_up], [w.clone() for w in w_down], TOP_K, True
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_forward_takes_the_kernels_on_cuda_ops(emulated_ops, assert_close, dtype):
    """CudaOps runs the layer through moe_experts on the experts stacked once (the lists then
    views of the stacks); TorchOps keeps the torch loop, whose result it matches."""
    moe = _moe_layer(dtype, seed=90)
    h = _randn(7, HIDDEN, dtype=dtype, seed=93)
    expected = moe.forward(TorchOps(), h)
    assert moe.stacked is None  # TorchOps (and CpuOps) never stack: loop or C MLP
    experts_before = [w.clone() for w in moe.gate_up]
    assert_close(moe.forward(emulated_ops, h), expected)
    stacked = moe.stacked
    assert stacked is not None and stacked.dense
    assert len({w.untyped_storage().data_ptr() for w in moe.gate_up}) == 1
    assert all(torch.equal(a, b) for a, b in zip(moe.gate_up, experts_before, strict=True))
    moe.forward(emulated_ops, h)
    assert moe.stacked is stacked  # reused while the lists hold its views


def test_moe_forward_stacks_again_after_the_experts_are_replaced(emulated_ops, assert_close):
    """Sleep mode puts new tensors in the lists on waking: the next forward stacks those."""
    moe = _moe_layer(torch.float32, seed=100)
    h = _randn(5, HIDDEN, dtype=torch.float32, seed=103)
    moe.forward(emulated_ops, h)
    first = moe.stacked
    moe.gate_up[:] = [w.clone() * 2 for w in moe.gate_up]
    moe.down[:] = [w.clone() for w in moe.down]
    expected = moe.forward(TorchOps(), h)
    assert_close(moe.forward(emulated_ops, h), expected)
    assert moe.stacked is not first and moe.stacked.dense


class _Blocks:
    """Stands for a packed or quantized expert (GGUF blocks, int8, 16-bit panels)."""


def test_moe_forward_keeps_the_loop_for_experts_not_dense_or_of_another_dtype(emulated_ops):
    moe = _moe_layer(torch.bfloat16, seed=110)
    h = _randn(3, HIDDEN, dtype=torch.float32, seed=113)
    assert moe.stacked_experts(emulated_ops, h) is None  # bfloat16 experts, float32 rows
    moe = _moe_layer(torch.float32, seed=110)
    moe.down[3] = _Blocks()
    assert moe.stacked_experts(emulated_ops, h) is None
    assert not moe.stacked.dense and moe.gate_up[0].untyped_storage().size() == (
        2 * INTERMEDIATE * HIDDEN * 4
    )  # nothing was stacked
