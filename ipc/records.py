"""Fixed-layout records between front ends and an engine core, and their codecs.

Request ring (MPSC, front ends -> core), one `REQUEST` record per message:

    kind   HELLO (payload: the sender's output-ring name) | ADD | ABORT | BYE
    seq    the front end's number for the request (the core answers with it)
    sampling fields the core uses (temperature ... prompt_logprobs), flags, priority
    blob   int32: prompt ids | stop_token_ids | eos ids | logit-bias ids | bias values (f32 bits)

Output ring (SPSC, core -> one front end), one `OUTPUT` record per request per step, all
of a step's records published with one counter store:

    kind   TOKENS | STATS | ERROR (a request the core refused; message in the blob)
    seq, up to MAX_TOKENS_PER_RECORD new token ids, finish reason, stop token, cached count
    blob   only with logprobs: int32 [n_sample_rows, n_prompt_rows, rows...],
           row = [rank, n, ids(n), logprob bits(n)]

Everything is numpy on both sides: no pickle, no per-message object graph.
"""

from __future__ import annotations

import numpy as np

from ringllm.pipeline.outputs import EngineCoreOutput
from ringllm.pipeline.request import Request
from ringllm.pipeline.sampling_params import SamplingParams
from ringllm.pipeline.scheduler_output import Logprobs
from ringllm.pipeline.stats import SchedulerStats

KIND_HELLO, KIND_ADD, KIND_ABORT, KIND_BYE, KIND_CONTROL = 1, 2, 3, 4, 5
KIND_TOKENS, KIND_STATS, KIND_ERROR = 1, 2, 3
CONTROL_RESET_PREFIX_CACHE = 1
FLAG_HAS_SEED, FLAG_IGNORE_EOS = 1, 2
MAX_TOKENS_PER_RECORD = 4
NAME_BYTES = 64
_FINISH_CODES = {None: 0, "stop": 1, "length": 2, "abort": 3}
_FINISH_NAMES = {code: name for name, code in _FINISH_CODES.items()}

REQUEST = np.dtype(
    [
        ("kind", np.uint8),
        ("flags", np.uint8),
        ("control", np.uint16),
        ("priority", np.int32),
        ("seq", np.uint64),
        ("blob_bytes", np.uint32),
        ("num_prompt_tokens", np.int32),
        ("arrival", np.float64),
        ("seed", np.uint64),
        ("temperature", np.float32),
        ("top_p", np.float32),
        ("top_k", np.int32),
        ("min_p", np.float32),
        ("presence_penalty", np.float32),
        ("frequency_penalty", np.float32),
        ("repetition_penalty", np.float32),
        ("max_tokens", np.int32),
        ("min_tokens", np.int32),
        ("logprobs", np.int32),
        ("prompt_logprobs", np.int32),
        ("num_stop_token_ids", np.int32),
        ("num_eos_token_ids", np.int32),
        ("num_logit_bias", np.int32),
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
    ]
)


def _none_as(value, missing: int) -> int:
    return missing if value is None else int(value)


# ---- requests ----------------------------------------------------------------------


def encode_hello(output_ring_name: str) -> np.ndarray:
    record = np.zeros(1, REQUEST)
    record["kind"] = KIND_HELLO
    record["name"] = output_ring_name.encode()
    return record


def encode_simple(kind: int, seqs: list[int] | None = None, control: int = 0) -> np.ndarray:
    records = np.zeros(max(len(seqs or ()), 1), REQUEST)
    records["kind"] = kind
    records["control"] = control
    if seqs:
        records["seq"] = seqs
    return records


def encode_add(seq: int, request: Request) -> tuple[np.ndarray, np.ndarray]:
    p = request.sampling_params
    r = np.zeros(1, REQUEST)
    r["kind"] = KIND_ADD
    r["seq"] = seq
    r["priority"] = request.priority
    r["arrival"] = request.times.arrival
    r["flags"] = (FLAG_HAS_SEED if p.seed is not None else 0) | (
        FLAG_IGNORE_EOS if p.ignore_eos else 0
    )
    r["seed"] = (p.seed or 0) % (1 << 64)
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty"):
        r[name] = getattr(p, name)
    r["repetition_penalty"] = p.repetition_penalty
    r["max_tokens"] = _none_as(p.max_tokens, -1)
    r["min_tokens"] = p.min_tokens
    r["logprobs"] = _none_as(p.logprobs, -1)
    r["prompt_logprobs"] = _none_as(p.prompt_logprobs, -1)
    bias = p.logit_bias or {}
    eos = sorted(request.eos_token_ids)
    r["num_prompt_tokens"] = request.num_prompt_tokens
    r["num_stop_token_ids"] = len(p.stop_token_ids)
    r["num_eos_token_ids"] = len(eos)
    r["num_logit_bias"] = len(bias)
    blob = np.concatenate(
        [
            np.asarray(request.prompt_token_ids, np.int32),
            np.asarray(p.stop_token_ids, np.int32),
            np.asarray(eos, np.int32),
            np.fromiter(bias.keys(), np.int32, len(bias)),
            np.fromiter(bias.values(), np.float32, len(bias)).view(np.int32),
        ]
    )
    return r, blob


def decode_add(record: np.void, blob: np.ndarray, request_id: str) -> Request:
    ints = blob.view(np.int32)
    n_prompt, n_stop = int(record["num_prompt_tokens"]), int(record["num_stop_token_ids"])
    n_eos, n_bias = int(record["num_eos_token_ids"]), int(record["num_logit_bias"])
    cuts = np.cumsum([n_prompt, n_stop, n_eos, n_bias, n_bias])
    if cuts[-1] != ints.size:
        raise ValueError(
            f"request record {request_id}: blob has {ints.size} ints, expected {cuts[-1]}"
        )
    prompt, stop, eos, bias_ids, bias_values = np.split(ints, cuts[:-1])
    flags = int(record["flags"])
    params = SamplingParams(
        temperature=float(record["temperature"]),
        top_p=float(record["top_p"]),
        top_k=int(record["top_k"]),
        min_p=float(record["min_p"]),
        presence_penalty=float(record["presence_penalty"]),
        frequency_penalty=float(record["frequency_penalty"]),
        repetition_penalty=float(record["repetition_penalty"]),
        seed=int(record["seed"]) if flags & FLAG_HAS_SEED else None,
        ignore_eos=bool(flags & FLAG_IGNORE_EOS),
        max_tokens=None if record["max_tokens"] < 0 else int(record["max_tokens"]),
        min_tokens=int(record["min_tokens"]),
        logprobs=None if record["logprobs"] < 0 else int(record["logprobs"]),
        prompt_logprobs=None if record["prompt_logprobs"] < 0 else int(record["prompt_logprobs"]),
        stop_token_ids=stop.tolist(),
        logit_bias=dict(zip(bias_ids.tolist(), bias_values.view(np.float32).tolist(), strict=True))
        or None,
    )
    return Request(
        request_id,
        prompt.tolist(),
        params,
        eos_token_ids=tuple(eos.tolist()),
        priority=int(record["priority"]),
        arrival_time=float(record["arrival"]),
    )


# ---- outputs -----------------------------------------------------------------------


def encode_outputs(
    seqs: list[int], outputs: list[EngineCoreOutput]
) -> tuple[np.ndarray, list[np.ndarray | None]]:
    """One TOKENS record per output (plus continuation records for > 4 tokens)."""
    rows, blobs = [], []
    for seq, out in zip(seqs, outputs, strict=True):
        tokens = out.new_token_ids
        chunks = [
            tokens[i : i + MAX_TOKENS_PER_RECORD]
            for i in range(0, len(tokens), MAX_TOKENS_PER_RECORD)
        ] or [[]]
        for k, chunk in enumerate(chunks):
            last = k == len(chunks) - 1
            rows.append((seq, chunk, out if last else None))
            blobs.append(_encode_logprobs(out) if last else None)
    records = np.zeros(len(rows), OUTPUT)
    records["kind"] = KIND_TOKENS
    for i, (seq, chunk, out) in enumerate(rows):
        rec = records[i]
        rec["seq"] = seq
        rec["num_tokens"] = len(chunk)
        rec["tokens"][: len(chunk)] = chunk
        rec["more"] = out is None
        if out is not None:
            rec["finish_reason"] = _FINISH_CODES[out.finish_reason]
            rec["queued_s"] = np.nan if out.queued_s is None else out.queued_s
            rec["num_cached_tokens"] = out.num_cached_tokens
            if isinstance(out.stop_reason, int):
                rec["has_stop_token"] = 1
                rec["stop_token"] = out.stop_reason
    return records, blobs


def _encode_logprobs(out: EngineCoreOutput) -> np.ndarray | None:
    sample, prompt = out.new_logprobs or [], out.new_prompt_logprobs or []
    if not sample and not prompt:
        return None
    parts = [np.array([len(sample), len(prompt)], np.int32)]
    for row in (*sample, *prompt):
        n = len(row.token_ids)
        parts.append(np.array([row.rank, n], np.int32))
        parts.append(np.asarray(row.token_ids, np.int32))
        parts.append(np.asarray(row.logprobs, np.float32).view(np.int32))
    return np.concatenate(parts)


def decode_logprobs(blob: np.ndarray) -> tuple[list[Logprobs], list[Logprobs]]:
    ints = blob.view(np.int32)
    num_sample, num_prompt = int(ints[0]), int(ints[1])
    rows, pos = [], 2
    for _ in range(num_sample + num_prompt):
        rank, n = int(ints[pos]), int(ints[pos + 1])
        ids = ints[pos + 2 : pos + 2 + n].tolist()
        values = ints[pos + 2 + n : pos + 2 + 2 * n].view(np.float32).tolist()
        rows.append(Logprobs(ids, values, rank))
        pos += 2 + 2 * n
    return rows[:num_sample], rows[num_sample:]


def encode_stats(stats: SchedulerStats) -> np.ndarray:
    r = np.zeros(1, OUTPUT)
    r["kind"] = KIND_STATS
    r["num_running"] = stats.num_running
    r["num_waiting"] = stats.num_waiting
    r["kv_cache_usage"] = stats.kv_cache_usage
    r["num_preemptions"] = stats.num_preemptions_total
    r["prefix_queries"] = stats.prefix_cache.queries
    r["prefix_hits"] = stats.prefix_cache.hits
    return r


def decode_stats(record: np.void) -> SchedulerStats:
    from ringllm.pipeline.kv_cache_manager import PrefixCacheStats

    return SchedulerStats(
        num_running=int(record["num_running"]),
        num_waiting=int(record["num_waiting"]),
        kv_cache_usage=float(record["kv_cache_usage"]),
        prefix_cache=PrefixCacheStats(int(record["prefix_queries"]), int(record["prefix_hits"])),
        num_preemptions_total=int(record["num_preemptions"]),
    )


def encode_error(seq: int, message: str) -> tuple[np.ndarray, np.ndarray]:
    r = np.zeros(1, OUTPUT)
    r["kind"] = KIND_ERROR
    r["seq"] = seq
    r["finish_reason"] = _FINISH_CODES["abort"]
    return r, np.frombuffer(message.encode(), np.uint8)


def finish_name(code: int) -> str | None:
    return _FINISH_NAMES[code]
