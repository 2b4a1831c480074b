"""Matrix products of the models: `linear(x, weight, bias)` over plain or prepacked weights.

On the CPU, oneDNN multiplies faster when a weight has been reordered once, at load, into
its blocked layout instead of on every call (measured per decode layer of the demo model,
64 rows: float32 2.5 -> 0.9 ms with AVX-512, 2.6 -> 1.8 ms with AVX2, against the BLAS
product `F.linear` uses; bfloat16 with AVX512_BF16 0.8 -> 0.5 ms). `prepack` does that
where the CPU and torch's oneDNN take the dtype (asked in pipeline/ops/cpu_features.py:
oneDNN refuses a bf16 or fp16 weight on a CPU without the instructions it needs), and
where a one-time probe of the op on this machine gave F.linear's answer. Anything else
stays a plain tensor and takes `F.linear`: that path runs on every CPU, and is what tests
compare the packed one with.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from ringllm.pipeline.ops.cpu_features import cpu_features

logger = logging.getLogger(__name__)

_BATCH_HINT = 64  # the decode batch the blocked layout is tuned for (any batch works)


def can_prepack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and cpu_features().prepacks(weight.dtype)
        and _probe(weight.dtype)
    )


def prepack(weight: torch.Tensor, enabled: bool = True) -> torch.Tensor:
    """The weight in oneDNN's blocked layout where that is available here, else unchanged."""
    if not (enabled and can_prepack(weight)):
        return weight
    return _pack(weight.contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)


@functools.cache
def _probe(dtype: torch.dtype) -> bool:
    """Packs and multiplies a small matrix once: True when the packed product runs here and
    agrees with F.linear (to the dtype's rounding), else the weights stay plain. A CPU that
    the feature checks misjudge then costs speed, never a failed start."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=gen).to(dtype)
    x = torch.randn(5, 32, generator=gen).to(dtype)
    try:
        got = linear(x, _pack(w)).float()
    except RuntimeError as e:
        logger.warning(
            "oneDNN prepacking of %s weights unavailable here (%s): plain F.linear", dtype, e
        )
        return False
    want = F.linear(x.float(), w.float())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    if not torch.allclose(got, want, rtol=tol, atol=tol * 4):
        logger.warning("oneDNN prepacked %s product disagrees with F.linear: plain F.linear", dtype)
        return False
    return True
