"""Beam search at the front-end level (as vLLM offers it): built from one-token steps.

Each step submits every live beam as a prompt (its token ids so far) for one token with
top-2k logprobs; the prefix cache makes re-submitting the shared history cheap. The k
best continuations by cumulative logprob survive; a beam that emits EOS is set aside
as finished (unless ignore_eos). At the end, finished and live beams are ranked by
cumulative_logprob / length ** length_penalty (length counts the prompt, and not a
final EOS), and the best k are returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ringllm.pipeline.frontend.input_processor import ProcessedPrompt
from ringllm.pipeline.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ringllm.pipeline.frontend.llm import LLM


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width: must be >= 1 beam, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1 token, got {self.max_tokens}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated
    num_prompt_tokens: int
    cum_logprob: float = 0.0
    logprobs: list[float] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_score(seq: BeamSearchSequence, eos_ids: set[int], length_penalty: float) -> float:
    length = len(seq.tokens)
    if seq.tokens and seq.tokens[-1] in eos_ids:
        length -= 1
    return seq.cum_logprob / (length**length_penalty)


def beam_search(llm: LLM, prompts: list[Any], params: BeamSearchParams) -> list[BeamSearchOutput]:
    engine = llm.llm_engine
    eos_ids = set(engine.eos_token_ids)
    live = []
    images = []  # each prompt's images (their positions stay: beams only append)
    for prompt in prompts:
        processed = engine.front_end.process_prompt(prompt)
        ids = processed.token_ids
        images.append(processed.mm_inputs)
        live.append([BeamSearchSequence(tokens=ids, num_prompt_tokens=len(ids))])
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    step_params = SamplingParams(
        max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature
    )
    for _ in range(params.max_tokens):
        flat = [(p, beam) for p, beams in enumerate(live) for beam in beams]
        if not flat:
            break
        outputs = llm.generate(
            [ProcessedPrompt(None, b.tokens, images[p]) for p, b in flat],
            step_params,
            use_tqdm=False,
        )
        candidates: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (p, beam), out in zip(flat, outputs, strict=True):
            for token, lp in out.outputs[0].logprobs[0].items():
                candidates[p].append(
                    BeamSearchSequence(
                        tokens=beam.tokens + [token],
                        num_prompt_tokens=beam.num_prompt_tokens,
                        cum_logprob=beam.cum_logprob + lp.logprob,
                        logprobs=beam.logprobs + [lp.logprob],
                    )
                )
        live = [_select(c, done[p], eos_ids, params) for p, c in enumerate(candidates)]
    return [_finish(engine, done[p] + live[p], eos_ids, params) for p in range(len(prompts))]


def _select(candidates, finished, eos_ids, params: BeamSearchParams) -> list[BeamSearchSequence]:
    candidates.sort(key=lambda s: s.cum_logprob, reverse=True)
    survivors = []
    for seq in candidates[: 2 * params.beam_width]:
        if not params.ignore_eos and seq.tokens[-1] in eos_ids:
            seq.finish_reason = "stop"
            finished.append(seq)
        elif len(survivors) < params.beam_width:
            survivors.append(seq)
    return survivors


def _finish(engine, sequences, eos_ids, params: BeamSearchParams) -> BeamSearchOutput:
    sequences.sort(key=lambda s: beam_score(s, eos_ids, params.length_penalty), reverse=True)
    best = sequences[: params.beam_width]
    for seq in best:
        seq.finish_reason = seq.finish_reason or "length"
        seq.text = engine.tokenizer.decode(seq.output_token_ids)
    return BeamSearchOutput(best)
