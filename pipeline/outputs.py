"""What the front end hands users: `RequestOutput` / `CompletionOutput`, with text. (What
the engine core emits, token ids only, is `EngineCoreOutput` in pipeline/messages.py.)

Logprobs follow vLLM's user-facing shape: per position a dict token id -> `Logprob`
(logprob, rank, decoded_token), holding the chosen token and the top-N.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    inter_token_latencies_s: list[float] = field(default_factory=list)
    e2e_latency_s: float | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # The request ended with an error instead (finished, its choices' finish_reason
    # "error"): ValueError when the engine refused it as given, RequestFailedError when it
    # failed while being computed. AsyncLLM raises it; LLMEngine hands it out.
    error: Exception | None = None
    # a pooling request's vector (float32 numpy array; pipeline/pooling.py), once finished
    pooled: object = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """`LLM.score`'s answer per pair (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]  # the two texts' tokens, one after the other
    outputs: ScoringOutput
    finished: bool = True


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s answer per prompt (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
