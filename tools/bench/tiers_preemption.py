"""`bench tiers`, part one: what a preemption costs, swap against recompute.

**Time lost per preemption, at a context of C tokens.** Two requests A and B, each with
a prompt of C random tokens, greedy, EOS ignored, on an engine whose device cache holds
exactly their two prompts (`2 x ceil(C / block_size)` blocks), whose token budget takes
both prompts in one step, and whose prefix cache is off (so a recompute is a recompute,
not a hit on the victim's own freed blocks):

    step      1         ...   p              p+1 ... f       f+1 ... r        r+1 ...
    A         prefill   decode decode        decode (alone)  finished
    B         prefill   decode preempted     (swapped out, or waiting)  resumed  decode (alone)

At step p both cross a block boundary: A takes the last free block and B, the later
arrival, is preempted (swap: its KV copied to the host tier in step p; recompute: freed).
B cannot come back before A finishes (A holds one block more than half the cache). After
f, B resumes: swapped in (one step: the copy back and a decode) or recomputed (one
prefill of its C + g tokens, then the token it was about to make). Each step is timed
around `LLMEngine.step()` and attributed from the scheduler's counters and B's status:

    time lost = (t[p] - median t of A's alone steps (p, f])         swap-out copy, or ~0
              + (sum t[f+1 .. r] - median t of B's alone steps after r)   swap-in, or prefill

i.e. what the preemption's steps took beyond the decode steps they stand in for. The
worker's own copy time (`tier_probes.CopyTimer`) is reported beside it (swap only). The
two modes alternate run by run on two engines built alike (swap with the host tier,
recompute with none: the engine before the tiers), so a noisy machine slows both alike.

**Throughput under preemption.** `--throughput-requests` requests of
`--throughput-input-len` + `--throughput-output-len` tokens (EOS ignored) in one
`LLM.generate`, on a device cache of `--throughput-gpu-blocks` blocks (default: 40% of
what they need at full length, so the decodes keep running out of blocks), with the
engine's own flags otherwise (prefix cache on),
for three engines: swap, recompute with the host tier (evicted prefix blocks are
offloaded there, so a recompute can load part of its KV back), recompute without it.
Reported: output tok/s (median over runs), preemptions and swap-outs per run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringllm.tools.bench.tier_probes import CopyTimer

PREEMPTION_MODES = ("swap", "recompute")
THROUGHPUT_MODES = ("swap", "recompute", "recompute-no-tier")


@dataclass
class StepRecord:
    seconds: float
    victim_status: str | None  # B's status after the step (None: finished)
    victim_tokens: int  # B's output tokens after the step
    num_preemptions: int  # in this step
    num_swaps: int
    copy_s: float  # the worker's tier copies in this step


def preemption_engine_fields(context_len: int, output_len: int, block_size: int) -> dict:
    """The engine fields that make the two-request scenario preempt exactly once."""
    blocks = -(-context_len // block_size)
    return {
        "num_gpu_blocks_override": 2 * blocks,
        "enable_prefix_caching": False,
        "max_num_batched_tokens": 2 * blocks * block_size,
        "max_num_seqs": 2,
        "max_model_len": context_len + output_len + block_size,
    }


def preemption_output_len(context_len: int, block_size: int, decode_steps: int) -> int:
    """Tokens each request makes: up to the block boundary where B is preempted, then
    `decode_steps` more (A's and B's alone steps, the reference)."""
    to_boundary = -(-context_len // block_size) * block_size - context_len + 1
    return to_boundary + decode_steps


def run_preemption(
    llm, timer: CopyTimer, prompts: tuple[list[int], list[int]], output_len: int, run: int
) -> dict[str, Any]:
    """One run of the scenario on `llm` (`timer`: its CopyTimer); the steps attributed
    (see the module doc)."""
    from ringllm.pipeline import SamplingParams

    engine = llm.llm_engine
    sched = engine.engine_core.scheduler
    survivor, victim = f"tiers-a-{run}", f"tiers-b-{run}"
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    start_s = time.perf_counter()
    for request_id, prompt in zip((survivor, victim), prompts, strict=True):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    steps: list[StepRecord] = []
    tokens = {survivor: 0, victim: 0}
    finished_s: dict[str, float] = {}
    while engine.has_unfinished_requests():
        preemptions, swaps, copies = sched.num_preemptions, sched.num_swaps, len(timer.calls)
        step_start_s = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - step_start_s
        for out in outputs:
            tokens[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                finished_s[out.request_id] = time.perf_counter() - start_s
        request = sched.requests.get(victim)
        steps.append(
            StepRecord(
                seconds,
                request.status.name if request is not None else None,
                tokens[victim],
                sched.num_preemptions - preemptions,
                sched.num_swaps - swaps,
                timer.seconds_since(copies),
            )
        )
    result = attribute_steps(steps)
    result["victim_e2e_s"] = finished_s[victim]
    result["elapsed_s"] = time.perf_counter() - start_s
    result["victim_context_tokens"] = len(prompts[1]) + result.pop("victim_tokens_at_preemption")
    return result


def attribute_steps(steps: list[StepRecord]) -> dict[str, Any]:
    """Which steps the preemption took, and what they cost beyond plain decode steps."""
    num_preemptions = sum(s.num_preemptions for s in steps)
    if num_preemptions != 1:
        raise RuntimeError(
            f"preemption scenario: expected exactly 1 preemption, the engine made "
            f"{num_preemptions} (steps: {[(s.victim_status, s.num_preemptions) for s in steps]})"
        )
    p = next(i for i, s in enumerate(steps) if s.num_preemptions)
    r = next(i for i in range(p + 1, len(steps)) if steps[i].victim_tokens > steps[p].victim_tokens)
    resume = [i for i in range(p + 1, r + 1) if steps[i].victim_status == "RUNNING" or i == r]
    alone_a = [s.seconds for s in steps[p + 1 : resume[0]]]
    alone_b = [s.seconds for s in steps[r + 1 :]]
    if not alone_a or not alone_b:
        raise RuntimeError("preemption scenario: no reference decode steps; raise --decode-steps")
    ref_a, ref_b = float(np.median(alone_a)), float(np.median(alone_b))
    out_excess = steps[p].seconds - ref_a
    resume_excess = sum(steps[i].seconds for i in resume) - ref_b
    return {
        "time_lost_s": out_excess + resume_excess,
        "preempt_step_excess_s": out_excess,
        "resume_excess_s": resume_excess,
        "resume_steps": len(resume),
        "reference_decode_step_s": ref_b,
        "copy_out_s": steps[p].copy_s,
        "copy_in_s": sum(steps[i].copy_s for i in resume),
        "num_preemptions": num_preemptions,
        "num_swaps": sum(s.num_swaps for s in steps),
        "victim_tokens_at_preemption": steps[p].victim_tokens,
    }


def preemption_prompts(vocab_pool: np.ndarray, context_len: int, seed: int):
    rng = np.random.default_rng(seed)
    return tuple(rng.choice(vocab_pool, size=context_len).tolist() for _ in range(2))


def run_throughput_once(
    llm, timer: CopyTimer, prompts: list[list[int]], output_len: int
) -> dict[str, Any]:
    """The batch in one `LLM.generate`, tiers emptied first; counts from the scheduler."""
    from ringllm.pipeline import SamplingParams

    sched = llm.llm_engine.engine_core.scheduler
    llm.reset_prefix_cache()
    before = (sched.num_preemptions, sched.num_swaps, len(timer.calls))
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    start_s = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed_s = time.perf_counter() - start_s
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    preemptions = sched.num_preemptions - before[0]
    swaps = sched.num_swaps - before[1]
    return {
        "elapsed_s": elapsed_s,
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / elapsed_s,
        "num_preemptions": preemptions,
        "num_swaps": swaps,
        "num_recomputes": preemptions - swaps,
        "num_cached_tokens": sum(o.num_cached_tokens for o in outputs),
        **timer.totals_since(before[2]),
    }


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The median of every numeric field over the runs."""
    return {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
