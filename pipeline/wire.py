"""The wire codecs of the engine's shared types: one per type, used by every ring.

`SamplingParams` crosses two rings: the request ring (a front end -> the engine core,
pipeline/engine/records.py) and the batch ring (the engine core -> its tensor-parallel
ranks, pipeline/executor/batch_records.py). Both embed the same fields and the same
variable-length part, so a request samples with exactly the parameters it has in process,
over either ring (floats travel as float64: `temperature=0.7` arrives as 0.7):

    SAMPLING_FIELDS (numpy fields of the ring's record, in this order)
        sp_flags u2 (pooling: POOL_SHIFT) | sp_output_kind u1 | n, top_k, max_tokens (-1: None), min_tokens,
        logprobs (-1), prompt_logprobs (-1), num_stop_token_ids, num_logit_bias, lora_id  i4
        | seed u8 (two's complement of a negative seed: FLAG_SEED_NEGATIVE)
        | temperature, top_p, min_p, presence/frequency/repetition_penalty  f8
    sampling_ints(p) (int32 words of the record's blob)
        stop_token_ids | logit-bias ids | logit-bias values (float64, two words each)

Front-end-only fields travel too except `stop` (stop strings are matched where the text is,
in the front end; the core and the workers never see text).

Logprob rows (`LogprobRow`) cross the output ring and the result ring as int32 words:

    per row: rank | n | token ids (n) | logprobs (n float32)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ringllm.ipc.tensor_slab import TensorRef
from ringllm.pipeline.messages import IMAGE_HASH_BYTES, ImageInput, LogprobRow
from ringllm.pipeline.pooling import POOLING_TYPES
from ringllm.pipeline.sampling_params import RequestOutputKind, SamplingParams

FLAG_HAS_SEED, FLAG_SEED_NEGATIVE, FLAG_IGNORE_EOS = 1, 2, 4
FLAG_SKIP_SPECIAL, FLAG_SPACES_BETWEEN_SPECIAL, FLAG_INCLUDE_STOP_STR = 8, 16, 32
# a pooling request: its type's index + 1 in bits 6-7 (0: none), normalize in bit 8
POOL_SHIFT, POOL_MASK, FLAG_POOL_NORMALIZE = 6, 3 << 6, 256
_NONE = -1
_OUTPUT_KINDS = list(RequestOutputKind)
_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_COUNTS = ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")

SAMPLING_FIELDS: list[tuple[str, type]] = [
    ("sp_flags", np.uint16),
    ("sp_output_kind", np.uint8),
    *[(name, np.int32) for name in _COUNTS],
    ("num_stop_token_ids", np.int32),
    ("num_logit_bias", np.int32),
    ("lora_id", np.int32),
    ("seed", np.uint64),
    *[(name, np.float64) for name in _FLOATS],
]
SAMPLING_NAMES = tuple(name for name, _ in SAMPLING_FIELDS)


def _none_as(value: int | None) -> int:
    return _NONE if value is None else int(value)


def _as_none(value: int) -> int | None:
    return None if value == _NONE else int(value)


def sampling_values(p: SamplingParams) -> tuple:
    """The SAMPLING_FIELDS values of `p`, in field order (for struct packing or a record)."""
    flags = FLAG_HAS_SEED | (FLAG_SEED_NEGATIVE if p.seed < 0 else 0) if p.seed is not None else 0
    flags |= FLAG_IGNORE_EOS if p.ignore_eos else 0
    flags |= FLAG_SKIP_SPECIAL if p.skip_special_tokens else 0
    flags |= FLAG_SPACES_BETWEEN_SPECIAL if p.spaces_between_special_tokens else 0
    flags |= FLAG_INCLUDE_STOP_STR if p.include_stop_str_in_output else 0
    if p.pooling_type is not None:
        flags |= (POOLING_TYPES.index(p.pooling_type) + 1) << POOL_SHIFT
        flags |= FLAG_POOL_NORMALIZE if p.pooling_normalize else 0
    return (
        flags,
        _OUTPUT_KINDS.index(p.output_kind),
        p.n,
        p.top_k,
        _none_as(p.max_tokens),
        p.min_tokens,
        _none_as(p.logprobs),
        _none_as(p.prompt_logprobs),
        len(p.stop_token_ids),
        len(p.logit_bias or ()),
        p.lora_id,
        (p.seed or 0) % (1 << 64),
        *(getattr(p, name) for name in _FLOATS),
    )


def sampling_ints(p: SamplingParams) -> np.ndarray:
    """The variable part of `p` as int32 words: stop ids | bias ids | bias values (f64)."""
    bias = p.logit_bias or {}
    return np.concatenate(
        [
            np.asarray(p.stop_token_ids, np.int32),
            np.fromiter(bias.keys(), np.int32, len(bias)),
            np.fromiter(bias.values(), np.float64, len(bias)).view(np.int32),
        ]
    )


def sampling_ints_size(values: Sequence) -> int:
    """How many int32 words `sampling_ints` wrote for a record with these field values."""
    fields = dict(zip(SAMPLING_NAMES, values, strict=True))
    return int(fields["num_stop_token_ids"]) + 3 * int(fields["num_logit_bias"])


def decode_sampling(values: Sequence, ints: np.ndarray) -> SamplingParams:
    """The `SamplingParams` of SAMPLING_FIELDS `values` and its `sampling_ints` words."""
    f = dict(zip(SAMPLING_NAMES, values, strict=True))
    n_stop, n_bias = int(f["num_stop_token_ids"]), int(f["num_logit_bias"])
    if ints.size != n_stop + 3 * n_bias:
        raise ValueError(
            f"sampling params: {ints.size} int32 words, the counts say {n_stop + 3 * n_bias}"
        )
    flags = int(f["sp_flags"])
    seed = None
    if flags & FLAG_HAS_SEED:
        seed = int(f["seed"]) - ((1 << 64) if flags & FLAG_SEED_NEGATIVE else 0)
    pool = (flags & POOL_MASK) >> POOL_SHIFT
    bias_ids = ints[n_stop : n_stop + n_bias]
    bias_values = ints[n_stop + n_bias :].view(np.float64)
    return SamplingParams(
        n=int(f["n"]),
        **{name: float(f[name]) for name in _FLOATS},
        top_k=int(f["top_k"]),
        seed=seed,
        stop_token_ids=ints[:n_stop].tolist(),
        ignore_eos=bool(flags & FLAG_IGNORE_EOS),
        max_tokens=_as_none(int(f["max_tokens"])),
        min_tokens=int(f["min_tokens"]),
        logprobs=_as_none(int(f["logprobs"])),
        prompt_logprobs=_as_none(int(f["prompt_logprobs"])),
        skip_special_tokens=bool(flags & FLAG_SKIP_SPECIAL),
        spaces_between_special_tokens=bool(flags & FLAG_SPACES_BETWEEN_SPECIAL),
        include_stop_str_in_output=bool(flags & FLAG_INCLUDE_STOP_STR),
        logit_bias=dict(zip(bias_ids.tolist(), bias_values.tolist(), strict=True)) or None,
        output_kind=_OUTPUT_KINDS[int(f["sp_output_kind"])],
        pooling_type=POOLING_TYPES[pool - 1] if pool else None,
        pooling_normalize=bool(flags & FLAG_POOL_NORMALIZE) or not pool,
        lora_id=int(f["lora_id"]),
    )


def record_sampling_values(record: np.void) -> tuple:
    """The SAMPLING_FIELDS values of a numpy record that embeds them."""
    return tuple(record[name].item() for name in SAMPLING_NAMES)


def set_record_sampling(record: np.ndarray, p: SamplingParams) -> None:
    """Writes `p`'s SAMPLING_FIELDS into a (one-element) record array."""
    for name, value in zip(SAMPLING_NAMES, sampling_values(p), strict=True):
        record[name] = value


# ---- logprob rows -------------------------------------------------------------------


def encode_logprob_rows(rows: Sequence[LogprobRow]) -> list[np.ndarray]:
    """The int32 parts of `rows`, to concatenate into a blob."""
    parts = []
    for row in rows:
        parts.append(np.array([row.rank, len(row.token_ids)], np.int32))
        parts.append(np.asarray(row.token_ids, np.int32))
        parts.append(np.asarray(row.logprobs, np.float32).view(np.int32))
    return parts


def decode_logprob_rows(ints: np.ndarray, pos: int, count: int) -> tuple[list[LogprobRow], int]:
    """`count` rows from int32 words at `pos`; returns them and the position after them."""
    rows = []
    for _ in range(count):
        if pos + 2 > ints.size:
            raise ValueError(f"logprob rows: {ints.size} words end inside a row header")
        rank, n = int(ints[pos]), int(ints[pos + 1])
        end = pos + 2 + 2 * n
        if n < 0 or end > ints.size:
            raise ValueError(f"logprob rows: a row of {n} entries runs past {ints.size} words")
        ids = ints[pos + 2 : pos + 2 + n].tolist()
        values = ints[pos + 2 + n : end].view(np.float32).tolist()
        rows.append(LogprobRow(ids, values, rank))
        pos = end
    return rows, pos


# ---- images --------------------------------------------------------------------------

# One image on a ring: offset, length, its 16-byte content hash, and the TensorRef of its
# pixel values in the sender's tensor slab (ipc/tensor_slab.py: 4 int64s); the request
# ring's ADD and the batch ring's NEW carry them alike.
IMAGE_INTS = 2 + IMAGE_HASH_BYTES // 4 + 2 * TensorRef.NUM_INTS
_HASH_AT, _REF_AT = 2, 2 + IMAGE_HASH_BYTES // 4


def encode_images(images: Sequence[ImageInput], refs: Sequence[TensorRef]) -> np.ndarray:
    """int32 words [len(images) * IMAGE_INTS]."""
    if len(refs) != len(images):
        raise ValueError(f"{len(images)} images but {len(refs)} tensor refs")
    words = np.zeros((len(images), IMAGE_INTS), np.int32)
    for row, image, ref in zip(words, images, refs, strict=True):
        row[0], row[1] = image.offset, image.length
        row[_HASH_AT:_REF_AT] = np.frombuffer(image.hash, np.int32)
        row[_REF_AT:] = np.asarray(ref.to_ints(), np.int64).view(np.int32)
    return words.reshape(-1)


def decode_images(words: np.ndarray) -> tuple[tuple[ImageInput, ...], list[TensorRef]]:
    """The images (without pixel values) and the refs of their pixel values."""
    if words.size % IMAGE_INTS:
        raise ValueError(f"{words.size} ints are not whole images of {IMAGE_INTS} ints")
    images, refs = [], []
    for row in words.reshape(-1, IMAGE_INTS):
        images.append(ImageInput(int(row[0]), int(row[1]), row[_HASH_AT:_REF_AT].tobytes()))
        refs.append(TensorRef.from_ints(row[_REF_AT:].copy().view(np.int64)))
    return tuple(images), refs


def images_with_pixels(images, refs, slab) -> tuple[ImageInput, ...]:
    """The images with their pixel values copied out of `slab` (a TensorSlabPeer): the
    sender frees them when it is done with them, so nothing keeps a view. ValueError when
    one was freed before it could be read (its request was aborted meanwhile)."""
    import dataclasses

    from ringllm.ipc.tensor_slab import StaleTensorRefError

    if slab is None:
        raise ValueError("images: the sender has no tensor slab this process could open")
    out = []
    for i, (image, ref) in enumerate(zip(images, refs, strict=True)):
        try:
            pixels = np.array(slab.get(ref))
            slab.get(ref)  # still that tensor after the copy: nothing was freed under it
        except StaleTensorRefError:
            raise ValueError(
                f"images[{i}]: its pixel values were freed before they could be read"
            ) from None
        out.append(dataclasses.replace(image, pixel_values=pixels))
    return tuple(out)
