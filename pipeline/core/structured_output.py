"""Structured outputs in the engine core: grammars compiled off the step loop, one matcher per
request, one bitmask per step for every constrained row.

    add_request   a request with `structured_outputs` waits here (not in the scheduler's
                  queue) while its grammar compiles on this manager's thread; equal specs
                  share one compile (a cache of compiled grammars keyed by the spec)
    each step     `take_ready` hands the scheduler those whose grammar is ready (each with
                  its own matcher, which has consumed the request's `num_prefix_tokens`:
                  a replayed request's output so far) and those that failed; after
                  scheduling, `fill_bitmask_soon` computes one mask row per constrained
                  request that samples in the step, on a thread (llguidance's threads, the
                  GIL released) while the step's model runs; the worker waits for it when
                  it samples
    each token    the scheduler calls `matcher.accept`; a matcher that terminates ends its
                  request with "stop"

The tokenizer the backend needs is built once, on the compile thread, when the first
constrained request comes (an engine that never sees one never pays for it).

A preempted request keeps its matcher as it is: its matcher follows the tokens the request
has produced, not the ones in the KV cache, and a recompute samples nothing it already had.
A compile that takes longer than `compile_timeout_s` ends its request with an error (the
compile itself runs on and its result is cached).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ringllm.pipeline.core.scheduler_output import GrammarBitmask
from ringllm.pipeline.structured.grammar import GrammarBackend, bitmask_words

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256


class StructuredOutputManager:
    def __init__(
        self, make_backend: Callable[[], GrammarBackend], compile_timeout_s: float
    ) -> None:
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self.compile_timeout_s = compile_timeout_s
        self._pool: ThreadPoolExecutor | None = None
        self._mask_pool: ThreadPoolExecutor | None = None
        self._cache: collections.OrderedDict[tuple[str, str], Future] = collections.OrderedDict()
        self._pending: dict[
            str, tuple[object, Future, float]
        ] = {}  # id -> (request, compile, since)
        self._bitmask = np.zeros((0, 0), np.int32)
        self.reset_counters()

    def reset_counters(self) -> None:
        """What the masks cost so far (`ringllm bench throughput --structured-outputs`)."""
        self.num_fills = 0
        self.rows_total = 0
        self.fill_s_total = 0.0

    # ---- compiling -----------------------------------------------------------------------

    def submit(self, request) -> None:
        """Starts (or joins) the compile of the request's spec; it waits here until ready."""
        key = request.sampling_params.structured_outputs.spec()
        future = self._cache.get(key)
        if future is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="ringllm-grammar")
            future = self._pool.submit(self._compile, *key)
            self._cache[key] = future
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        self._pending[request.request_id] = (request, future, time.monotonic())

    def _compile(self, kind: str, text: str):
        if self._backend is None:
            self._backend = self._make_backend()
        started = time.perf_counter()
        grammar = self._backend.compile(kind, text)
        logger.debug(
            "grammar (%s, %d chars) compiled in %.3f s",
            kind,
            len(text),
            time.perf_counter() - started,
        )
        return grammar

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def is_pending(self, request_id: str) -> bool:
        """Whether the request still waits for its grammar (it is in no queue yet)."""
        return request_id in self._pending

    def forget(self, request_id: str) -> bool:
        """An aborted request that was still waiting for its grammar; True if it was."""
        return self._pending.pop(request_id, None) is not None

    def take_ready(self) -> tuple[list, list[tuple[object, str]]]:
        """(requests now ready, each with `request.matcher` set; (request, error) pairs)."""
        ready, failed = [], []
        now = time.monotonic()
        for rid, (request, future, since) in list(self._pending.items()):
            if not future.done():
                if now - since > self.compile_timeout_s:
                    del self._pending[rid]
                    failed.append(
                        (
                            request,
                            f"structured_outputs: the grammar did not compile within {self.compile_timeout_s:g} s",
                        )
                    )
                continue
            del self._pending[rid]
            error = future.exception()
            if error is not None:
                failed.append((request, _message(error)))
                continue
            matcher = future.result().matcher()
            params = request.sampling_params.structured_outputs
            prefix = (
                request.prompt_token_ids[len(request.prompt_token_ids) - params.num_prefix_tokens :]
                if params.num_prefix_tokens
                else []
            )
            if prefix and not matcher.accept(prefix):
                failed.append(
                    (request, "structured_outputs: the replayed output does not match its grammar")
                )
                continue
            request.matcher = matcher
            ready.append(request)
        return ready, failed

    # ---- each step -----------------------------------------------------------------------

    def step_bitmask(self, requests: list) -> GrammarBitmask | None:
        """The mask rows of the constrained requests among a step's `requests` that sample
        in it (those whose scheduled tokens reach the end of what they have); None: none."""
        sampling = [
            r for r in requests if r.matcher is not None and r.num_computed_tokens >= r.num_tokens
        ]
        if not sampling:
            return None
        return GrammarBitmask([r.request_id for r in sampling], self.fill_bitmask_soon(sampling))

    def fill_bitmask_soon(self, requests: list) -> Future:
        """`fill_bitmask` on this manager's mask thread (the backend releases the GIL): the
        step's model runs meanwhile, and the worker waits only when it samples. The caller
        must wait for it before the matchers move on (EngineCore.step does)."""
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="ringllm-grammar-mask")
        return self._mask_pool.submit(self.fill_bitmask, requests)

    def fill_bitmask(self, requests: list) -> np.ndarray:
        """int32 [len(requests), words]: row i is what requests[i]'s matcher allows next."""
        backend = self._backend
        words = bitmask_words(backend.vocab_size)
        if self._bitmask.shape[0] < len(requests) or self._bitmask.shape[1] != words:
            self._bitmask = np.zeros(
                (max(len(requests), 2 * self._bitmask.shape[0]), words), np.int32
            )
        started = time.perf_counter()
        bitmask = self._bitmask[: len(requests)]
        backend.fill_bitmasks([(r.matcher, i) for i, r in enumerate(requests)], self._bitmask)
        bitmask = bitmask.copy()  # the step's own: the buffer is refilled next step
        self.fill_s_total += time.perf_counter() - started
        self.num_fills += 1
        self.rows_total += len(requests)
        return bitmask

    def shutdown(self) -> None:
        for pool in (self._pool, self._mask_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)


def _message(error: BaseException) -> str:
    if isinstance(error, ValueError):
        return str(error)
    return f"structured_outputs: the grammar could not be built ({type(error).__name__}: {error})"
