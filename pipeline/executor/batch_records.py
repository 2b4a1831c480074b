"""Fixed-layout records between the engine core and its worker ranks (tensor-parallel and
pipeline stages alike).

Batch ring (broadcast: the engine core writes, every rank reads every record). One step
is its new requests, then one STEP record that closes it:

    NEW      one per newly scheduled request: handle, counts, SamplingParams as
             pipeline/wire.py's SAMPLING_FIELDS (the codec the request ring uses too)
             blob int32: token ids | eos ids | sampling ints (wire.py) | block ids
                         | images (wire.py IMAGE_INTS each: offsets, hash, the TensorRef
                           of its pixel values in the engine core's slab, which every
                           rank copies out when it reads the record; freed once the step
                           is done) | request id (utf-8, zero-padded to 4 bytes)
    STEP     counts of scheduled / finished / cached requests, num_preempted
             blob int32: scheduled handles | scheduled token counts | finished handles
                         | cached handles | computed counts | resumed | new-block counts
                         | new block ids (all cached requests, concatenated)
                         | speculative decoding: handles of the requests verifying
                           drafts | their draft counts | the drafts, concatenated
                         | pipeline parallelism: the cached requests (their index
                           among them) with tokens sampled since their last step |
                           their counts | the tokens, concatenated (the stages that
                           do not sample take them in)
                         | KV transfers between tiers (core/kv_tiers.py), as int32 rows:
                           to_disk (host, slot, hash as 4 words) | to_host (device, host)
                           | to_device (host, device) | from_disk (slot, device, hash)
                         | structured outputs: handles of the constrained requests that
                           sample | their grammar bitmask rows (int32 words, row-major)
    INIT_KV  num_blocks to allocate (all ranks agree: the min over ranks)
    INIT_TIERS  make the host / disk KV tiers (worker/kv_tiers.py)
    SLEEP    value = the sleep level (pipeline/worker/sleep.py): free the KV cache, offload
             or drop the weights
    WAKE     value = which parts come back (bits of worker/sleep.py's WAKE_TAGS; 0: all)
    SHUTDOWN no payload: leave the loop

Result ring (SPSC, rank 0 -> engine core), one record per answer:

    OUTPUT      blob int32: sampled token per scheduled request (-1: none) | has logprobs
                | prompt-logprob row count (-1: none) | accepted-draft count | proposed-
                draft count | accepted drafts | proposed drafts (each concatenated) | rows,
                row = [rank, n, ids(n), f32 bits(n)]: sampled tokens', then accepted drafts'
                (requests with logprobs), then prompt rows
    NUM_BLOCKS  value = the KV blocks every rank can hold (min over ranks)
    TIERS       value = host-tier blocks, num_reqs = disk-tier slots (every rank alike);
                blob int32 rows [slot, hash as 4 words]: the disk entries all ranks hold
    KV_READY    every rank allocated its KV cache
    DONE        every rank carried out a SLEEP or WAKE
    ERROR       blob: utf-8 message of the exception a rank raised

Request ids are strings of any length, so the engine side gives each request an int32
*handle* when it is first sent (`BatchEncoder`) and both sides drop it when the id comes
back in `finished_request_ids`. Results carry no ids at all: they follow the order of the
step's `num_scheduled_tokens`, which the engine side still holds.

Sampling fields are float64 on the ring (wire.py), so a request samples with exactly the
parameters it has in process and over the request ring.

Everything is numpy on both sides: no pickle, no per-message object graph.
"""

from __future__ import annotations

import json

import numpy as np

from ringllm.pipeline import wire
from ringllm.pipeline.core.scheduler_output import (
    CachedRequestData,
    GrammarBitmask,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

KIND_NEW, KIND_STEP, KIND_INIT_KV, KIND_SHUTDOWN, KIND_SLEEP, KIND_WAKE = 1, 2, 3, 4, 5, 6
KIND_INIT_TIERS = 7
KIND_LORA_ADD, KIND_LORA_REMOVE = 8, 9  # value: the adapter's id; add: {"path", "name"} blob
KIND_OUTPUT, KIND_NUM_BLOCKS, KIND_KV_READY, KIND_ERROR, KIND_DONE = 1, 2, 3, 4, 5
KIND_TIERS = 6
NO_TOKEN = -1
NO_ROWS = -1
MAX_HANDLE = 2**31 - 1
_NO_INTS = np.zeros(0, np.int32)

BATCH = np.dtype(
    [
        ("kind", np.uint8),
        ("blob_bytes", np.uint32),
        ("handle", np.int32),
        ("num_token_ids", np.int32),
        ("num_prompt_tokens", np.int32),
        ("num_computed_tokens", np.int32),
        ("num_block_ids", np.int32),
        ("num_eos_token_ids", np.int32),
        ("num_id_bytes", np.int32),
        ("num_scheduled", np.int32),
        ("num_finished", np.int32),
        ("num_cached", np.int32),
        ("num_preempted", np.int32),
        ("num_grammar", np.int32),
        ("num_spec", np.int32),
        ("num_synced", np.int32),
        ("num_images", np.int32),
        ("num_to_disk", np.int32),
        ("num_to_host", np.int32),
        ("num_to_device", np.int32),
        ("num_from_disk", np.int32),
        ("value", np.int64),
        *wire.SAMPLING_FIELDS,
    ]
)

RESULT = np.dtype(
    [
        ("kind", np.uint8),
        ("blob_bytes", np.uint32),
        ("num_reqs", np.int32),
        ("value", np.int64),
    ]
)


def _text_ints(text: str) -> tuple[np.ndarray, int]:
    data = text.encode()
    padded = data + b"\0" * (-len(data) % 4)
    return np.frombuffer(padded, np.int32), len(data)


def _ints(blob: np.ndarray | None) -> np.ndarray:
    """A blob as int32; None (an empty blob travels as a plain record) is no ints."""
    return _NO_INTS if blob is None else blob.view(np.int32)


# ---- batch ring: engine side -------------------------------------------------------


class BatchEncoder:
    """Engine side: turns a `SchedulerOutput` into records + blobs; owns the handles."""

    def __init__(self, slab=None) -> None:
        self.handle_of: dict[str, int] = {}
        self._next_handle = 0
        self.slab = slab  # a TensorSlab for images' pixel values (a model that takes them)
        self._image_tags: list[int] = []  # handles whose pixel values this step put there

    def free_step_images(self) -> None:
        """After the step: every rank has copied its images' pixel values out."""
        self.free_images(self.take_step_images())

    def take_step_images(self) -> list[int]:
        """The tags of the images the steps encoded since the last call put in the slab
        (batches in flight: each frees its own once its result is back)."""
        tags, self._image_tags = self._image_tags, []
        return tags

    def free_images(self, tags: list[int]) -> None:
        for tag in tags:
            self.slab.free_tag(tag)

    def encode(self, sched: SchedulerOutput) -> list[tuple[np.ndarray, np.ndarray]]:
        """The step's (record, blob) pairs, in ring order: NEW records, then STEP."""
        finished = [
            self.handle_of.pop(rid) for rid in sched.finished_request_ids if rid in self.handle_of
        ]
        messages = [self._encode_new(new) for new in sched.new_requests]
        messages.append(self._encode_step(sched, finished))
        return messages

    def _take_handle(self, request_id: str) -> int:
        if request_id in self.handle_of:
            raise ValueError(f"request {request_id!r} is sent as new twice without finishing")
        # NOTE: wraps after 2**31 requests; a handle is only reused once its request is long gone.
        handle = self._next_handle
        self._next_handle = (handle + 1) % (MAX_HANDLE + 1)
        self.handle_of[request_id] = handle
        return handle

    def _encode_new(self, new: NewRequestData) -> tuple[np.ndarray, np.ndarray]:
        r = np.zeros(1, BATCH)
        r["kind"] = KIND_NEW
        r["handle"] = self._take_handle(new.request_id)
        wire.set_record_sampling(r, new.sampling_params)
        id_ints, id_bytes = _text_ints(new.request_id)
        r["num_token_ids"] = len(new.token_ids)
        r["num_prompt_tokens"] = new.num_prompt_tokens
        r["num_computed_tokens"] = new.num_computed_tokens
        r["num_block_ids"] = len(new.block_ids)
        r["num_eos_token_ids"] = len(new.eos_token_ids)
        r["num_id_bytes"] = id_bytes
        images = _NO_INTS
        if new.mm_inputs:
            if self.slab is None:
                raise ValueError(f"request {new.request_id!r} has images, the ranks no slab")
            handle = int(r["handle"][0])
            self._image_tags.append(handle)
            refs = [self.slab.put(image.pixel_values, handle) for image in new.mm_inputs]
            images = wire.encode_images(new.mm_inputs, refs)
            r["num_images"] = len(new.mm_inputs)
        blob = np.concatenate(
            [
                np.asarray(new.token_ids, np.int32),
                np.asarray(new.eos_token_ids, np.int32),
                wire.sampling_ints(new.sampling_params),
                np.asarray(new.block_ids, np.int32),
                images,
                id_ints,
            ]
        )
        return r, blob

    def _encode_step(
        self, sched: SchedulerOutput, finished: list[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        handle_of = self.handle_of
        cached = sched.cached_requests
        r = np.zeros(1, BATCH)
        r["kind"] = KIND_STEP
        r["num_scheduled"] = len(sched.num_scheduled_tokens)
        r["num_finished"] = len(finished)
        r["num_cached"] = len(cached)
        r["num_preempted"] = sched.num_preempted
        grammar = sched.grammar
        grammar_parts = []
        if grammar is not None:
            r["num_grammar"] = len(grammar.request_ids)
            grammar_parts = [
                np.fromiter((handle_of[rid] for rid in grammar.request_ids), np.int32),
                np.ascontiguousarray(grammar.bitmask, np.int32).ravel(),
            ]
        spec = sched.scheduled_spec_tokens
        r["num_spec"] = len(spec)
        synced = [(k, c.new_token_ids) for k, c in enumerate(cached) if c.new_token_ids]
        r["num_synced"] = len(synced)
        transfer_parts = _encode_transfers(r, sched.kv_transfers)
        blob = np.concatenate(
            [
                np.fromiter((handle_of[rid] for rid in sched.num_scheduled_tokens), np.int32),
                np.fromiter(sched.num_scheduled_tokens.values(), np.int32),
                np.asarray(finished, np.int32),
                np.fromiter((handle_of[c.request_id] for c in cached), np.int32),
                np.fromiter((c.num_computed_tokens for c in cached), np.int32),
                np.fromiter((c.resumed for c in cached), np.int32),
                np.fromiter((len(c.new_block_ids) for c in cached), np.int32),
                np.fromiter((b for c in cached for b in c.new_block_ids), np.int32),
                np.fromiter((handle_of[rid] for rid in spec), np.int32),
                np.fromiter((len(d) for d in spec.values()), np.int32),
                np.fromiter((t for d in spec.values() for t in d), np.int32),
                np.fromiter((k for k, _ in synced), np.int32),
                np.fromiter((len(t) for _, t in synced), np.int32),
                np.fromiter((t for _, tokens in synced for t in tokens), np.int32),
                *transfer_parts,
                *grammar_parts,
            ]
        )
        return r, blob


def encode_init_kv(num_blocks: int) -> np.ndarray:
    r = np.zeros(1, BATCH)
    r["kind"] = KIND_INIT_KV
    r["value"] = num_blocks
    return r


def encode_init_tiers() -> np.ndarray:
    r = np.zeros(1, BATCH)
    r["kind"] = KIND_INIT_TIERS
    return r


def encode_tiers(
    num_host_blocks: int, num_disk_slots: int, entries: dict[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """TIERS: the host blocks, the disk slots, and (blob) the disk entries every rank
    holds alike as int32 rows [slot, hash as 4 words]."""
    r = encode_value(KIND_TIERS, num_host_blocks)
    r["num_reqs"] = num_disk_slots
    words = np.zeros((len(entries), 5), np.int32)
    for row, (block_hash, slot) in zip(words, entries.items(), strict=True):
        row[0] = slot
        row[1:] = np.frombuffer(block_hash.to_bytes(16, "little"), np.int32)
    return r, words.ravel()


def decode_tiers(record: np.void, blob: np.ndarray | None) -> tuple[int, int, dict[int, int]]:
    rows = _ints(blob).reshape(-1, 5)
    entries = {int.from_bytes(row[1:].tobytes(), "little"): int(row[0]) for row in rows}
    return int(record["value"]), int(record["num_reqs"]), entries


def encode_shutdown() -> np.ndarray:
    return encode_command(KIND_SHUTDOWN)


def encode_lora_add(lora_id: int, path: str, name: str) -> tuple[np.ndarray, np.ndarray]:
    """LORA_ADD: every rank reads the adapter at `path` (its shard) under `lora_id`."""
    text = json.dumps({"path": path, "name": name}).encode()
    return encode_command(KIND_LORA_ADD, lora_id), np.frombuffer(text, np.uint8)


def decode_lora_add(record: np.void, blob) -> tuple[int, str, str]:
    spec = json.loads(bytes(np.asarray(blob)))
    return int(record["value"]), spec["path"], spec["name"]


def encode_command(kind: int, value: int = 0) -> np.ndarray:
    """A record with no blob: SHUTDOWN, SLEEP (value: the level), WAKE."""
    r = np.zeros(1, BATCH)
    r["kind"] = kind
    r["value"] = value
    return r


# ---- batch ring: rank side ---------------------------------------------------------


class BatchDecoder:
    """Rank side: collects a step's NEW records, then rebuilds the `SchedulerOutput`."""

    def __init__(self, slab=None) -> None:
        self.id_of: dict[int, str] = {}
        self._pending: list[NewRequestData] = []
        self.slab = slab  # the engine core's TensorSlab (a peer), for images

    def add_new(self, record: np.void, blob: np.ndarray | None) -> None:
        new = _decode_new(record, blob, self.slab)
        self.id_of[int(record["handle"])] = new.request_id
        self._pending.append(new)

    def finish_step(self, record: np.void, blob: np.ndarray | None) -> SchedulerOutput:
        ints = _ints(blob)
        n_sched, n_fin = int(record["num_scheduled"]), int(record["num_finished"])
        n_cached = int(record["num_cached"])
        fixed = np.cumsum([n_sched, n_sched, n_fin, n_cached, n_cached, n_cached, n_cached])
        sections = np.split(ints[: fixed[-1]], fixed[:-1])
        sched_h, sched_n, fin_h, cached_h, computed, resumed, num_new_blocks = sections
        num_blocks = int(num_new_blocks.sum())
        block_ids = ints[fixed[-1] : fixed[-1] + num_blocks]
        at = fixed[-1] + num_blocks
        n_spec = int(record["num_spec"])
        spec_h, spec_n = ints[at : at + n_spec], ints[at + n_spec : at + 2 * n_spec]
        at += 2 * n_spec
        num_drafts = int(spec_n.sum())
        draft_ids = ints[at : at + num_drafts]
        at += num_drafts
        n_synced = int(record["num_synced"])
        synced_k, synced_n = ints[at : at + n_synced], ints[at + n_synced : at + 2 * n_synced]
        at += 2 * n_synced
        num_synced = int(synced_n.sum())
        synced_ids = ints[at : at + num_synced]
        at += num_synced
        transfers, at = _decode_transfers(record, ints, at)
        grammar_ints = ints[at:]
        n_grammar = int(record["num_grammar"])
        if (
            block_ids.size != num_blocks
            or spec_n.size != n_spec
            or draft_ids.size != num_drafts
            or synced_ids.size != num_synced
            or (n_synced and int(synced_k.max()) >= n_cached)
            or (grammar_ints.size > 0) != (n_grammar > 0)
        ):
            raise ValueError(
                f"STEP record: blob holds {ints.size - fixed[-1]} ints after its fixed "
                f"sections, the cached requests announce {num_blocks} block ids, "
                f"{n_spec} requests verifying drafts, {n_synced} with sampled tokens and "
                f"{n_grammar} grammar rows"
            )
        id_of = self.id_of
        block_lists = np.split(block_ids, np.cumsum(num_new_blocks)[:-1]) if n_cached else []
        cached = [
            CachedRequestData(id_of[h], blocks.tolist(), c, bool(res))
            for h, c, res, blocks in zip(
                cached_h.tolist(), computed.tolist(), resumed.tolist(), block_lists, strict=True
            )
        ]
        if n_synced:
            runs = np.split(synced_ids, np.cumsum(synced_n)[:-1])
            for k, run in zip(synced_k.tolist(), runs, strict=True):
                cached[k].new_token_ids = run.tolist()
        sched = SchedulerOutput(
            new_requests=self._pending,
            cached_requests=cached,
            num_scheduled_tokens={
                id_of[h]: n for h, n in zip(sched_h.tolist(), sched_n.tolist(), strict=True)
            },
            finished_request_ids={id_of.pop(h) for h in fin_h.tolist()},
            num_preempted=int(record["num_preempted"]),
            grammar=_decode_grammar(grammar_ints, n_grammar, id_of),
            kv_transfers=transfers,
            scheduled_spec_tokens={
                id_of[h]: d.tolist()
                for h, d in zip(
                    spec_h.tolist(), np.split(draft_ids, np.cumsum(spec_n)[:-1]), strict=True
                )
            }
            if n_spec
            else {},
        )
        self._pending = []
        return sched


_TRANSFER_FIELDS = (  # KVTransfers list, record count field, ints per row
    ("to_disk", "num_to_disk", 6),
    ("to_host", "num_to_host", 2),
    ("to_device", "num_to_device", 2),
    ("from_disk", "num_from_disk", 6),
)


def _encode_transfers(record: np.ndarray, transfers) -> list[np.ndarray]:
    if transfers is None:
        return []
    parts = []
    for name, count_field, width in _TRANSFER_FIELDS:
        rows = getattr(transfers, name)
        record[count_field] = len(rows)
        if not rows:
            continue
        if width == 2:
            parts.append(np.asarray(rows, np.int32).ravel())
            continue
        words = np.zeros((len(rows), width), np.int32)
        for row, (a, b, block_hash) in zip(words, rows, strict=True):
            row[0], row[1] = a, b
            row[2:] = np.frombuffer(block_hash.to_bytes(16, "little"), np.int32)
        parts.append(words.ravel())
    return parts


def _decode_transfers(record: np.void, ints: np.ndarray, at: int):
    from ringllm.pipeline.core.scheduler_output import KVTransfers

    counts = [int(record[field]) for _, field, _ in _TRANSFER_FIELDS]
    if not any(counts):
        return None, at
    transfers = KVTransfers()
    for (name, _, width), count in zip(_TRANSFER_FIELDS, counts, strict=True):
        rows = ints[at : at + count * width].reshape(count, width)
        if rows.shape[0] != count:
            raise ValueError(f"STEP record: {name} announces {count} rows the blob does not hold")
        at += count * width
        if width == 2:
            getattr(transfers, name).extend(map(tuple, rows.tolist()))
        else:
            getattr(transfers, name).extend(
                (int(r[0]), int(r[1]), int.from_bytes(r[2:].tobytes(), "little")) for r in rows
            )
    return transfers, at


def _decode_grammar(ints: np.ndarray, rows: int, id_of: dict[int, str]) -> GrammarBitmask | None:
    if not rows:
        return None
    words, extra = divmod(ints.size - rows, rows)
    if extra or words < 1:
        raise ValueError(f"STEP record: {ints.size} grammar ints do not make {rows} mask rows")
    handles = ints[:rows].tolist()
    return GrammarBitmask([id_of[h] for h in handles], ints[rows:].reshape(rows, words).copy())


def _decode_new(record: np.void, blob: np.ndarray | None, slab=None) -> NewRequestData:
    ints = _ints(blob)
    sampling = wire.record_sampling_values(record)
    counts = [
        int(record["num_token_ids"]),
        int(record["num_eos_token_ids"]),
        wire.sampling_ints_size(sampling),
        int(record["num_block_ids"]),
        int(record["num_images"]) * wire.IMAGE_INTS,
    ]
    cuts = np.cumsum(counts)
    id_bytes = int(record["num_id_bytes"])
    expected = int(cuts[-1]) + -(-id_bytes // 4)
    if ints.size != expected:
        raise ValueError(f"NEW record: blob has {ints.size} ints, its counts say {expected}")
    tokens, eos, sampling_ints, blocks, image_ints, id_ints = np.split(ints, cuts)
    images = ()
    if image_ints.size:
        images = wire.images_with_pixels(*wire.decode_images(image_ints), slab)
    return NewRequestData(
        request_id=id_ints.view(np.uint8)[:id_bytes].tobytes().decode(),
        token_ids=tokens.tolist(),
        num_prompt_tokens=int(record["num_prompt_tokens"]),
        sampling_params=wire.decode_sampling(sampling, sampling_ints),
        eos_token_ids=tuple(eos.tolist()),
        block_ids=blocks.tolist(),
        num_computed_tokens=int(record["num_computed_tokens"]),
        mm_inputs=images,
    )


# ---- result ring -------------------------------------------------------------------


def encode_output(out: ModelRunnerOutput) -> tuple[np.ndarray, np.ndarray]:
    """Rank 0's answer to a step; rows follow `out.req_ids` (the step's scheduled order)."""
    n = len(out.req_ids)
    prompt_rows = [out.prompt_logprobs.get(rid) for rid in out.req_ids]
    accepted = [out.accepted_token_ids.get(rid, ()) for rid in out.req_ids]
    proposed = [out.spec_token_ids.get(rid, ()) for rid in out.req_ids]
    parts = [
        np.fromiter((NO_TOKEN if t is None else t for t in out.sampled_token_ids), np.int32, n),
        np.fromiter((lp is not None for lp in out.logprobs), np.int32, n),
        np.fromiter((NO_ROWS if rows is None else len(rows) for rows in prompt_rows), np.int32, n),
        np.fromiter((len(a) for a in accepted), np.int32, n),
        np.fromiter((len(p) for p in proposed), np.int32, n),
        np.fromiter((t for a in accepted for t in a), np.int32),
        np.fromiter((t for p in proposed for t in p), np.int32),
    ]
    rows = [lp for lp in out.logprobs if lp is not None]
    rows += [
        row
        for rid, lp in zip(out.req_ids, out.logprobs, strict=True)
        if lp is not None
        for row in out.accepted_logprobs.get(rid, ())
    ]
    rows += [row for rows_i in prompt_rows if rows_i for row in rows_i]
    parts += wire.encode_logprob_rows(rows)
    parts += _encode_pooled(out)
    r = np.zeros(1, RESULT)
    r["kind"] = KIND_OUTPUT
    r["num_reqs"] = n
    return r, np.concatenate(parts)


def decode_output(
    record: np.void, blob: np.ndarray | None, req_ids: list[str]
) -> ModelRunnerOutput:
    ints = _ints(blob)
    n = int(record["num_reqs"])
    if n != len(req_ids):
        raise ValueError(f"OUTPUT record answers {n} requests, the step scheduled {len(req_ids)}")
    tokens, has_lp, prompt_counts = ints[:n].tolist(), ints[n : 2 * n], ints[2 * n : 3 * n].tolist()
    num_accepted, num_proposed = ints[3 * n : 4 * n], ints[4 * n : 5 * n]
    pos = 5 * n
    accepted_ids = ints[pos : pos + int(num_accepted.sum())]
    pos += accepted_ids.size
    proposed_ids = ints[pos : pos + int(num_proposed.sum())]
    pos += proposed_ids.size
    flags = has_lp.tolist()
    sample_rows, pos = wire.decode_logprob_rows(ints, pos, sum(flags))
    sample_iter = iter(sample_rows)
    logprobs = [next(sample_iter) if flag else None for flag in flags]
    out = ModelRunnerOutput(list(req_ids), [None if t == NO_TOKEN else t for t in tokens], logprobs)
    runs = np.split(accepted_ids, np.cumsum(num_accepted)[:-1]) if n else []
    for rid, flag, run in zip(req_ids, flags, runs, strict=True):
        if run.size:
            out.accepted_token_ids[rid] = run.tolist()
            if flag:
                out.accepted_logprobs[rid], pos = wire.decode_logprob_rows(ints, pos, run.size)
    proposals = np.split(proposed_ids, np.cumsum(num_proposed)[:-1]) if n else []
    for rid, drafts in zip(req_ids, proposals, strict=True):
        if drafts.size:
            out.spec_token_ids[rid] = drafts.tolist()
    for rid, count in zip(req_ids, prompt_counts, strict=True):
        if count != NO_ROWS:
            out.prompt_logprobs[rid], pos = wire.decode_logprob_rows(ints, pos, count)
    pos = _decode_pooled(ints, pos, out)
    if pos != ints.size:
        raise ValueError(f"OUTPUT record: blob has {ints.size} ints, its rows used {pos}")
    return out


def _encode_pooled(out: ModelRunnerOutput) -> list[np.ndarray]:
    """Each request's pooled vector length (0: none), then the vectors' float32 words."""
    vectors = [out.pooled.get(rid) for rid in out.req_ids]
    lengths = np.fromiter((0 if v is None else v.size for v in vectors), np.int32, len(vectors))
    data = [np.ascontiguousarray(v, np.float32).view(np.int32) for v in vectors if v is not None]
    return [lengths, *data]


def _decode_pooled(ints: np.ndarray, pos: int, out: ModelRunnerOutput) -> int:
    n = len(out.req_ids)
    lengths = ints[pos : pos + n].tolist()
    pos += n
    for rid, length in zip(out.req_ids, lengths, strict=True):
        if length:
            out.pooled[rid] = ints[pos : pos + length].view(np.float32).copy()
            pos += length
    return pos


def encode_value(kind: int, value: int = 0) -> np.ndarray:
    r = np.zeros(1, RESULT)
    r["kind"] = kind
    r["value"] = value
    return r


def encode_error(message: str) -> tuple[np.ndarray, np.ndarray]:
    r = np.zeros(1, RESULT)
    r["kind"] = KIND_ERROR
    return r, np.frombuffer(message.encode() or b" ", np.uint8)
