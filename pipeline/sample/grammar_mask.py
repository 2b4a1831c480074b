"""A grammar's token bitmask applied to logits: the worker's side of structured outputs.

A bitmask row (pipeline/structured/grammar.py) is ceil(vocab / 32) int32 words; token t is bit t % 32
of word t // 32. What a row refuses becomes -inf, before the sampler does anything else.
On the CPU one C pass does it (the ops module's `token_bitmask`); torch ops elsewhere
(`apply_bitmask_torch`, which is also the reference the C pass is tested against).
"""

from __future__ import annotations

import numpy as np


def allowed_tokens(bitmask_rows: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool [rows, vocab_size]: which tokens each row allows."""
    rows = np.ascontiguousarray(bitmask_rows, dtype=np.int32)
    bits = np.unpackbits(rows.view(np.uint8), axis=1, bitorder="little")
    if bits.shape[1] < vocab_size:  # a vocabulary wider than the mask: the rest refused
        bits = np.pad(bits, ((0, 0), (0, vocab_size - bits.shape[1])))
    return bits[:, :vocab_size].astype(bool)


def apply_bitmask(logits, bitmask_rows: np.ndarray) -> None:
    """logits (torch float [rows, vocab]) in place: what each row's mask refuses is -inf.
    CPU float32 rows: one C pass (the ops module's token_bitmask, ~6x torch's masked_fill
    here); elsewhere torch ops (`apply_bitmask_torch`, the reference)."""
    import torch

    rows = np.ascontiguousarray(bitmask_rows, dtype=np.int32)
    if (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.stride(1) == 1
        and rows.shape[0] == logits.shape[0]
    ):
        from ringllm.pipeline.ops import cpu_kernels

        cpu_kernels.token_bitmask(
            torch.get_num_threads(), logits.data_ptr(), logits.stride(0), rows.ctypes.data,
            rows.shape[1], rows.shape[0], logits.shape[1],
        )  # fmt: skip
        return
    apply_bitmask_torch(logits, rows)


def apply_bitmask_torch(logits, bitmask_rows: np.ndarray) -> None:
    import torch

    allowed = torch.from_numpy(allowed_tokens(bitmask_rows, logits.shape[1])).to(logits.device)
    logits.masked_fill_(~allowed, float("-inf"))
