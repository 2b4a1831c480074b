"""Fixed-layout records between front ends and an engine core, and their codecs.

Request ring (MPSC, front ends -> core), one `REQUEST` record per message:

    kind   HELLO (payload: the sender's output-ring name) | ADD | ABORT | BYE | CONTROL | PAUSE
    seq    the front end's tag for the request on this connection (the core answers with it);
           CONTROL: the command's ticket (SLEEP and WAKE_UP are answered with a REPLY)
    CONTROL: `control` says which (RESET_PREFIX_CACHE | SLEEP | WAKE_UP), `priority` carries
         its argument (SLEEP: the level)
    PAUSE: request `seq`'s client reads none of its outputs: `control` 1 stops scheduling
         it, 0 (its client reads again) resumes it
    ADD: an `EngineCoreRequest` (pipeline/messages.py): priority, arrival, counts, its
         cache salt's 16-byte digest (zeros: none), and its SamplingParams as pipeline/wire.py's SAMPLING_FIELDS (float64: the one codec of
         SamplingParams, which the batch ring to the workers uses too)
    blob   int32: prompt ids | eos ids | sampling ints (wire.py) | images | request id,
           group id, structured-output spec text (utf-8, together zero-padded to 4 bytes);
           the spec's kind and its replayed-prefix count are record fields; each image is
           IMAGE_INTS words: offset, length, its 16-byte content hash, and the TensorRef
           (ipc/tensor_slab.py, 4 int64s) of its pixel values in the front end's slab
    HELLO: the output ring's name in `name`; its blob, when the front end has a tensor
           slab for images, the slab's name (utf-8)

The request id crosses once, in the ADD: the engine core names the request by it (logs,
errors, the workers); `seq` only tags this connection's records.

Output ring (SPSC, core -> one front end), one `OUTPUT` record per request per step, all
of a step's records published with one counter store:

    kind   TOKENS | STATS | ERROR (a request's end with an error, its finish_reason field
           ERROR_REFUSED (the core would not take it) or ERROR_FAILED (it failed while
           being computed); the message in the blob) | REPLY (a control command done: seq
           its ticket, num_cached_tokens the core's sleep level after it, finish_reason 1
           if it failed, the message in the blob)
    seq, up to MAX_TOKENS_PER_RECORD new token ids, finish reason, stop token, cached count
    blob   only with logprobs or a pooled vector: int32 [n_sample_rows, n_prompt_rows,
           n_pooled, rows... (wire.py rows), the pooled vector's float32 words]

Everything is numpy on both sides: no pickle, no per-message object graph. The codecs
pack and unpack whole records with a `struct.Struct` derived from the dtype (`struct_of`),
one C call per record instead of one numpy field access per field; a step's outputs are
packed in one C call for all of them (`RecordPacker`, ipc/packer.py).
"""

from __future__ import annotations

import array
import struct
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from ringllm.ipc.packer import STRUCT_CODES, RecordPacker
from ringllm.ipc.tensor_slab import TensorRef
from ringllm.pipeline import wire
from ringllm.pipeline.config import MAX_SPECULATIVE_TOKENS
from ringllm.pipeline.messages import (
    CACHE_SALT_BYTES,
    EngineCoreOutput,
    EngineCoreRequest,
    LogprobRow,
)
from ringllm.pipeline.stats import KVTierStats, SchedulerStats, TierStats
from ringllm.pipeline.structured.params import SPEC_KINDS, StructuredOutputsParams

KIND_HELLO, KIND_ADD, KIND_ABORT, KIND_BYE, KIND_CONTROL, KIND_PAUSE = 1, 2, 3, 4, 5, 6
KIND_TOKENS, KIND_STATS, KIND_ERROR, KIND_REPLY = 1, 2, 3, 4
CONTROL_RESET_PREFIX_CACHE, CONTROL_SLEEP, CONTROL_WAKE_UP = 1, 2, 3
CONTROL_ADD_LORA, CONTROL_REMOVE_LORA = 4, 5  # value: the adapter's id; add: JSON blob
MAX_TOKENS_PER_RECORD = 4
NAME_BYTES = 64
_FINISH_CODES = {None: 0, "stop": 1, "length": 2, "abort": 3, "error": 4}
# An ERROR record's finish_reason field says which error it is (its blob: the message).
ERROR_REFUSED, ERROR_FAILED = 1, 2
_FINISH_NAMES = {code: name for name, code in _FINISH_CODES.items()}

REQUEST = np.dtype(
    [
        ("kind", np.uint8),
        ("control", np.uint16),
        ("priority", np.int32),
        ("seq", np.uint64),
        ("blob_bytes", np.uint32),
        ("num_prompt_tokens", np.int32),
        ("num_eos_token_ids", np.int32),
        ("num_id_bytes", np.int32),
        ("num_group_bytes", np.int32),
        ("grammar_kind", np.uint8),  # 0: none, else 1 + index in SPEC_KINDS
        ("num_grammar_bytes", np.int32),
        ("num_grammar_prefix_tokens", np.int32),
        ("num_images", np.int32),
        ("arrival", np.float64),
        ("cache_salt", f"S{CACHE_SALT_BYTES}"),  # its digest; all zero: no salt
        *wire.SAMPLING_FIELDS,
        ("name", f"S{NAME_BYTES}"),
    ]
)

OUTPUT = np.dtype(
    [
        ("kind", np.uint8),
        ("finish_reason", np.uint8),
        ("has_stop_token", np.uint8),
        ("num_tokens", np.uint8),
        ("more", np.uint8),  # 1: the next record continues this output (> 4 new tokens)
        ("num_cached_tokens", np.int32),
        ("queued_s", np.float32),  # NaN: not the request's first output
        ("seq", np.uint64),
        ("blob_bytes", np.uint32),
        ("stop_token", np.int32),
        ("tokens", np.int32, (MAX_TOKENS_PER_RECORD,)),
        ("num_running", np.int32),
        ("num_waiting", np.int32),
        ("kv_cache_usage", np.float32),
        ("num_preemptions", np.int32),
        ("prefix_queries", np.int64),
        ("prefix_hits", np.int64),
        # speculative decoding since the last STATS (spec_drafts -1: speculation is off)
        ("spec_drafts", np.int32),
        ("spec_draft_tokens", np.int32),
        ("spec_accepted", np.int32),
        ("spec_accepted_per_pos", np.int32, (MAX_SPECULATIVE_TOKENS,)),
        # the KV tiers (tier_num_swapped -1: no host tier; disk[0] -1: no disk tier); each
        # tier: TierStats.FIELDS
        ("tier_num_swapped", np.int32),
        ("tier_totals", np.int64, (3,)),  # swaps, blocks swapped out, blocks swapped in
        ("tier_host", np.int64, (6,)),
        ("tier_disk", np.int64, (6,)),
    ]
)


def struct_of(dtype: np.dtype) -> struct.Struct:
    """A `struct.Struct` with exactly the bytes of one `dtype` record (little-endian).

    NOTE: the codecs pack and unpack whole records with it: one C call per record, where
    setting or reading each numpy field costs 0.1-0.5 us apiece (20 fields: 5-10 us).
    """
    codes, position = ["<"], 0
    for name, (field, offset, *_) in sorted(dtype.fields.items(), key=lambda item: item[1][1]):
        codes.append(f"{offset - position}x" if offset > position else "")
        base, count = field.base, int(np.prod(field.shape)) if field.shape else 1
        if base.kind == "S":
            codes.append(f"{base.itemsize}s")
        elif (base.kind, base.itemsize) in STRUCT_CODES and base.byteorder in "<=|":
            codes.append(f"{count if count > 1 else ''}{STRUCT_CODES[base.kind, base.itemsize]}")
        else:
            raise ValueError(f"record field {name!r} of type {field} has no struct code")
        position = offset + field.itemsize
    codes.append(f"{dtype.itemsize - position}x" if dtype.itemsize > position else "")
    packer = struct.Struct("".join(codes))
    if packer.size != dtype.itemsize:
        raise AssertionError(f"struct {packer.format} is {packer.size} bytes, not {dtype.itemsize}")
    return packer


REQUEST_STRUCT = struct_of(REQUEST)
OUTPUT_STRUCT = struct_of(OUTPUT)
# A TOKENS record leaves the stats fields (num_running ... prefix_hits) zero: its rows stop
# at `tokens`, the packer zeroes the rest.
_TOKENS_FIELDS = OUTPUT.names[: OUTPUT.names.index("tokens") + 1]
_TOKENS_PACKER = RecordPacker(
    np.dtype(
        {
            "names": _TOKENS_FIELDS,
            "formats": [OUTPUT.fields[name][0] for name in _TOKENS_FIELDS],
            "offsets": [OUTPUT.fields[name][1] for name in _TOKENS_FIELDS],
            "itemsize": OUTPUT.itemsize,
        }
    )
)
_NAN = float("nan")


# ---- requests ----------------------------------------------------------------------


def encode_hello(output_ring_name: str, slab_name: str = "") -> tuple[np.ndarray, np.ndarray]:
    record = np.zeros(1, REQUEST)
    record["kind"] = KIND_HELLO
    record["name"] = output_ring_name.encode()
    return record, np.frombuffer(slab_name.encode(), np.uint8)


def decode_hello(record: np.void, blob) -> tuple[str, str]:
    """(output ring name, tensor slab name or "") of a HELLO record."""
    slab = bytes(np.asarray(blob)).decode() if blob is not None else ""
    return record["name"].decode(), slab


def encode_simple(kind: int, seqs: list[int] | None = None, control: int = 0) -> np.ndarray:
    records = np.zeros(max(len(seqs or ()), 1), REQUEST)
    records["kind"] = kind
    records["control"] = control
    if seqs:
        records["seq"] = seqs
    return records


def encode_pauses(marks: list[tuple[int, bool]]) -> np.ndarray:
    """One PAUSE record per (seq, paused), in order: paused True stops scheduling request
    `seq`, False resumes it."""
    records = np.zeros(len(marks), REQUEST)
    records["kind"] = KIND_PAUSE
    records["seq"] = [seq for seq, _ in marks]
    records["control"] = [paused for _, paused in marks]
    return records


def encode_control(code: int, ticket: int = 0, arg: int = 0) -> np.ndarray:
    record = encode_simple(KIND_CONTROL, [ticket] if ticket else None, control=code)
    record["priority"] = arg
    return record


def encode_add(
    seq: int, request: EngineCoreRequest, image_refs=()
) -> tuple[np.ndarray, np.ndarray]:
    """One ADD record and its blob (see the module docstring); `image_refs`: where each of
    the request's images' pixel values is in the sender's tensor slab."""
    id_bytes = request.request_id.encode()
    group_bytes = request.group_id.encode()
    structured = request.sampling_params.structured_outputs
    grammar_kind, grammar_bytes, grammar_prefix = 0, b"", 0
    if structured is not None:
        kind, text = structured.spec()
        grammar_kind, grammar_bytes = 1 + SPEC_KINDS.index(kind), text.encode()
        grammar_prefix = structured.num_prefix_tokens
    packed = REQUEST_STRUCT.pack(
        KIND_ADD,
        0,  # control
        request.priority,
        seq,
        0,  # blob_bytes: write_with_blob sets it
        request.num_prompt_tokens,
        len(request.eos_token_ids),
        len(id_bytes),
        len(group_bytes),
        grammar_kind,
        len(grammar_bytes),
        grammar_prefix,
        len(request.mm_inputs),
        request.arrival_time,
        request.cache_salt,  # struct zero-pads b"" (no salt)
        *wire.sampling_values(request.sampling_params),
        b"",  # name
    )
    # int32 ids in one array('i') (C int: 4 bytes on every platform numpy and Linux share).
    ints = array.array("i", request.prompt_token_ids)
    ints.extend(request.eos_token_ids)
    ints.frombytes(wire.sampling_ints(request.sampling_params).tobytes())
    if request.mm_inputs:
        ints.frombytes(wire.encode_images(request.mm_inputs, image_refs).tobytes())
    text = id_bytes + group_bytes + grammar_bytes
    ints.frombytes(text + b"\0" * (-len(text) % 4))
    return np.frombuffer(bytearray(packed), REQUEST), np.frombuffer(ints, np.int32)


_SAMPLING_AT = REQUEST.names.index(wire.SAMPLING_NAMES[0])
_SAMPLING_END = _SAMPLING_AT + len(wire.SAMPLING_NAMES)


def decode_add(record: np.void, blob: np.ndarray) -> EngineCoreRequest:
    """The `EngineCoreRequest` of an ADD record; ValueError if its blob does not fit it.
    Its images come without pixel values (`decode_add_with_refs` says where they are)."""
    return decode_add_with_refs(record, blob)[0]


def decode_add_with_refs(
    record: np.void, blob: np.ndarray
) -> tuple[EngineCoreRequest, list[TensorRef]]:
    """An ADD record's request and the tensor refs of its images' pixel values."""
    fields = REQUEST_STRUCT.unpack(record.tobytes())
    (
        _kind, _control, priority, _seq, _blob_bytes, n_prompt, n_eos, id_bytes, group_bytes,
        grammar_kind, grammar_bytes, grammar_prefix, num_images, arrival, cache_salt,
    ) = fields[:_SAMPLING_AT]  # fmt: skip
    sampling = fields[_SAMPLING_AT:_SAMPLING_END]
    ints = blob.view(np.int32)
    eos_at = n_prompt + n_eos
    images_at = eos_at + wire.sampling_ints_size(sampling)
    if num_images < 0:
        raise ValueError(f"ADD record: {num_images} images")
    id_at = images_at + num_images * wire.IMAGE_INTS
    text_bytes = id_bytes + group_bytes + grammar_bytes
    text_words = -(-text_bytes // 4)
    if id_at + text_words != ints.size:
        raise ValueError(
            f"ADD record: blob has {ints.size} ints, its counts say {id_at + text_words}"
        )
    if grammar_kind > len(SPEC_KINDS):
        raise ValueError(f"ADD record: structured-output kind {grammar_kind} is unknown")
    text = ints[id_at:].view(np.uint8)[:text_bytes].tobytes()
    params = wire.decode_sampling(sampling, ints[eos_at:images_at])
    if grammar_kind:
        params.structured_outputs = StructuredOutputsParams.from_spec(
            SPEC_KINDS[grammar_kind - 1],
            text[id_bytes + group_bytes :].decode(),
            grammar_prefix,
        )
    images, refs = wire.decode_images(ints[images_at:id_at]) if num_images else ((), [])
    request = EngineCoreRequest(
        request_id=text[:id_bytes].decode(),
        prompt_token_ids=ints[:n_prompt].tolist(),
        sampling_params=params,
        eos_token_ids=tuple(ints[n_prompt:eos_at].tolist()),
        arrival_time=arrival,
        priority=priority,
        group_id=text[id_bytes : id_bytes + group_bytes].decode(),
        mm_inputs=images,
        cache_salt=cache_salt if any(cache_salt) else b"",
    )
    return request, refs


# ---- outputs -----------------------------------------------------------------------


def encode_outputs(
    seqs: list[int], outputs: list[EngineCoreOutput]
) -> tuple[np.ndarray, list[np.ndarray | None]]:
    """One TOKENS record per output (plus continuation records for > 4 tokens).

    The step's rows are packed in one C call (`RecordPacker`); `tokens` takes the chunk's
    token ids and the packer zeroes the rest of the field.
    """
    rows, blobs = [], []
    for seq, out in zip(seqs, outputs, strict=True):
        tokens = out.new_token_ids
        start = 0
        while len(tokens) - start > MAX_TOKENS_PER_RECORD:  # continuation: more = 1
            end = start + MAX_TOKENS_PER_RECORD
            chunk = tokens[start:end]
            rows.append((KIND_TOKENS, 0, 0, MAX_TOKENS_PER_RECORD, 1, 0, 0.0, seq, 0, 0, chunk))
            blobs.append(None)
            start = end
        chunk = tokens[start:] if start else tokens
        stop_token = out.stop_reason if isinstance(out.stop_reason, int) else None
        rows.append(
            (
                KIND_TOKENS,
                _FINISH_CODES[out.finish_reason],
                stop_token is not None,
                len(chunk),
                0,  # more
                out.num_cached_tokens,
                _NAN if out.queued_s is None else out.queued_s,
                seq,
                0,  # blob_bytes: write_with_blob sets it
                stop_token or 0,
                chunk,
            )
        )
        blobs.append(_encode_blob(out))
    return np.frombuffer(bytearray(_TOKENS_PACKER.pack(rows)), OUTPUT), blobs


def unpack_outputs(records: np.ndarray) -> Iterator[tuple]:
    """The fields of each OUTPUT record as a tuple, in dtype order (tokens as 4 ints)."""
    return OUTPUT_STRUCT.iter_unpack(records.tobytes())


def _encode_blob(out: EngineCoreOutput) -> np.ndarray | None:
    sample, prompt = out.new_logprobs or [], out.new_prompt_logprobs or []
    pooled = out.pooled
    if not sample and not prompt and pooled is None:
        return None
    size = 0 if pooled is None else pooled.size
    head = np.array([len(sample), len(prompt), size], np.int32)
    parts = [head, *wire.encode_logprob_rows([*sample, *prompt])]
    if pooled is not None:
        parts.append(np.ascontiguousarray(pooled, np.float32).view(np.int32))
    return np.concatenate(parts)


class OutputBlob(NamedTuple):
    sample_logprobs: list[LogprobRow]
    prompt_logprobs: list[LogprobRow]
    pooled: np.ndarray | None


def decode_blob(blob: np.ndarray) -> OutputBlob:
    ints = blob.view(np.int32)
    num_sample, num_prompt, num_pooled = int(ints[0]), int(ints[1]), int(ints[2])
    rows, end = wire.decode_logprob_rows(ints, 3, num_sample + num_prompt)
    pooled = ints[end : end + num_pooled].view(np.float32).copy() if num_pooled else None
    end += num_pooled
    if end != ints.size:
        raise ValueError(f"output blob: {ints.size} ints, its rows and vector used {end}")
    return OutputBlob(rows[:num_sample], rows[num_sample:], pooled)


def encode_stats(stats: SchedulerStats) -> np.ndarray:
    r = np.zeros(1, OUTPUT)
    r["kind"] = KIND_STATS
    r["num_running"] = stats.num_running
    r["num_waiting"] = stats.num_waiting
    r["kv_cache_usage"] = stats.kv_cache_usage
    r["num_preemptions"] = stats.num_preemptions_total
    r["prefix_queries"] = stats.prefix_cache.queries
    r["prefix_hits"] = stats.prefix_cache.hits
    spec = stats.spec_decoding
    if spec is None:
        r["spec_drafts"] = -1
    else:
        r["spec_drafts"] = spec.num_drafts
        r["spec_draft_tokens"] = spec.num_draft_tokens
        r["spec_accepted"] = spec.num_accepted_tokens
        per_pos = spec.accepted_per_pos[:MAX_SPECULATIVE_TOKENS]
        r["spec_accepted_per_pos"][0, : len(per_pos)] = per_pos
    tiers = stats.kv_tiers
    if tiers is None:
        r["tier_num_swapped"] = -1
    else:
        r["tier_num_swapped"] = tiers.num_swapped
        r["tier_totals"] = (
            tiers.num_swaps_total,
            tiers.blocks_swapped_out_total,
            tiers.blocks_swapped_in_total,
        )
        r["tier_host"] = tiers.host.values()
        r["tier_disk"] = tiers.disk.values() if tiers.disk is not None else (-1,) * 6
    return r


def decode_stats(row: tuple) -> SchedulerStats:
    """Stats from an `unpack_outputs` row of a STATS record."""
    from ringllm.pipeline.stats import PrefixCacheStats, SpecDecodingStats

    at = _STATS_AT
    num_running, num_waiting, kv_cache_usage, num_preemptions, queries, hits = row[at : at + 6]
    at += 6
    drafts, draft_tokens, accepted, *per_pos = row[at : at + 3 + MAX_SPECULATIVE_TOKENS]
    at += 3 + MAX_SPECULATIVE_TOKENS
    tiers = _decode_tiers(row[at : at + 16])
    spec = None
    if drafts >= 0:
        while per_pos and per_pos[-1] == 0:
            per_pos.pop()
        spec = SpecDecodingStats(drafts, draft_tokens, accepted, per_pos)
    return SchedulerStats(
        num_running=num_running,
        num_waiting=num_waiting,
        kv_cache_usage=kv_cache_usage,
        prefix_cache=PrefixCacheStats(queries, hits),
        num_preemptions_total=num_preemptions,
        spec_decoding=spec,
        kv_tiers=tiers,
    )


def _decode_tiers(values) -> KVTierStats | None:
    num_swapped, swaps, blocks_out, blocks_in = values[:4]
    if num_swapped < 0:
        return None
    host, disk = values[4:10], values[10:16]
    return KVTierStats(
        num_swapped,
        swaps,
        blocks_out,
        blocks_in,
        TierStats(*host),
        TierStats(*disk) if disk[0] >= 0 else None,
    )


# where the stats fields begin in an `unpack_outputs` row (arrays unpack as their elements)
_STATS_AT = sum(
    int(np.prod(OUTPUT.fields[name][0].shape or (1,)))
    for name in OUTPUT.names[: OUTPUT.names.index("num_running")]
)


def encode_error(seq: int, message: str, refused: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The end of request `seq` with an error: refused (the request as given cannot run)
    or failed (the engine failed computing it)."""
    r = np.zeros(1, OUTPUT)
    r["kind"] = KIND_ERROR
    r["seq"] = seq
    r["finish_reason"] = ERROR_REFUSED if refused else ERROR_FAILED
    return r, np.frombuffer(message.encode(), np.uint8)


def encode_reply(
    ticket: int, sleep_level: int, error: str | None
) -> tuple[np.ndarray, np.ndarray | None]:
    r = np.zeros(1, OUTPUT)
    r["kind"] = KIND_REPLY
    r["seq"] = ticket
    r["num_cached_tokens"] = sleep_level
    r["finish_reason"] = error is not None
    return r, None if error is None else np.frombuffer(error.encode() or b" ", np.uint8)


def finish_name(code: int) -> str | None:
    return _FINISH_NAMES[code]
