"""Per-request sampling parameters: `SamplingParams` and `RequestOutputKind`.

Field names and defaults follow vLLM's `SamplingParams`, so code written for vLLM's
offline API keeps working. Validation happens once, in `__post_init__`, and raises
`ValueError` naming the field, the value and the allowed range; the rest of the engine
may then trust every field.

Invariants after construction:
- `stop` and `stop_token_ids` are lists (never None; a single stop string becomes a
  one-element list).
- `logit_bias` is None or a dict of int token id -> float bias clamped to [-100, 100].
- numeric fields are within their documented ranges; `min_tokens <= max_tokens` when
  `max_tokens` is set.

This module knows token ids only, never a tokenizer: checks that need the vocabulary
size live in `check_token_ids`, called by whoever knows it.
"""

from __future__ import annotations

import copy
import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass

from ringllm.pipeline.pooling import POOLING_TYPES
from ringllm.pipeline.structured.params import StructuredOutputsParams

# Most top-N logprobs a request may ask for, for sampled and prompt tokens (vLLM's default).
MAX_LOGPROBS = 20
# Temperatures below this are treated as greedy decoding (argmax).
GREEDY_TEMPERATURE = 1e-5
# OpenAI's documented range for logit_bias values; larger values are clamped, not refused.
MAX_ABS_LOGIT_BIAS = 100.0
# torch.Generator.manual_seed accepts exactly this range.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1
# The wire (pipeline/wire.py) carries n, top_k, max_tokens and min_tokens as int32.
MAX_INT32 = 2**31 - 1
# The sampler applies the float fields to float32 logits: a value must be 0 or a normal
# float32 (a smaller magnitude becomes 0 there, a larger one inf: a division by zero or an
# inf / inf NaN in the row). The wire itself carries float64.
FLOAT32_TINY = 1.1754943508222875e-38
FLOAT32_MAX = 3.4028234663852886e38


class RequestOutputKind(enum.Enum):
    """What each streamed output of a request carries."""

    CUMULATIVE = 0  # all tokens / text so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # one output, when the request finishes


def _is_int(value: object) -> bool:
    # bool is an int subclass; `top_k=True` is a mistake, not a 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    logprobs: int | None = None  # top-N per sampled token; 0 = only the sampled token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    use_beam_search: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # the output must match a JSON schema, regex, choice or grammar (structured/params.py)
    structured_outputs: StructuredOutputsParams | None = None
    # a pooling request (pipeline/pooling.py): its prompt's vector, no token sampled
    pooling_type: str | None = None  # "last" | "mean" | "cls"
    pooling_normalize: bool = True
    # the LoRA adapter the request runs with (models/lora.py), set by the front end from
    # the request's LoRARequest; 0: the base model
    lora_id: int = 0

    def __post_init__(self) -> None:
        self._normalize_stops()
        self._check_counts()
        self._check_floats()
        self._check_logprobs()
        self._normalize_logit_bias()
        if self.seed is not None and not (_is_int(self.seed) and MIN_SEED <= self.seed <= MAX_SEED):
            raise ValueError(
                f"seed: must be an int in [{MIN_SEED}, {MAX_SEED}] or None, got {self.seed!r}"
            )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(
                f"output_kind: must be a RequestOutputKind "
                f"({', '.join(k.name for k in RequestOutputKind)}), got {self.output_kind!r}"
            )
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs: must be a StructuredOutputsParams (json, regex, choice, "
                f"grammar or json_object), got {type(self.structured_outputs).__name__}"
            )
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type: must be one of {', '.join(POOLING_TYPES)} or None, "
                f"got {self.pooling_type!r}"
            )
        if not isinstance(self.pooling_normalize, bool):
            raise ValueError(
                f"pooling_normalize: must be True or False, got {self.pooling_normalize!r}"
            )
        if self.use_beam_search:
            raise ValueError(
                "use_beam_search: not supported in SamplingParams; got True, use False "
                "(LLM.beam_search takes BeamSearchParams)"
            )

    def _normalize_stops(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(
                f"stop: must be a non-empty string or a list of them, got {self.stop!r}"
            )
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if not all(_is_int(t) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids: must be token ids (ints >= 0, at most {MAX_INT32}), "
                f"got {self.stop_token_ids!r}"
            )

    def _check_counts(self) -> None:
        if not (_is_int(self.lora_id) and 0 <= self.lora_id <= MAX_INT32):
            raise ValueError(f"lora_id: must be an int in [0, {MAX_INT32}], got {self.lora_id!r}")
        if not (_is_int(self.n) and 1 <= self.n <= MAX_INT32):
            raise ValueError(f"n: must be an int in [1, {MAX_INT32}] sequences, got {self.n!r}")
        if not (_is_int(self.top_k) and -1 <= self.top_k <= MAX_INT32):
            raise ValueError(
                f"top_k: must be an int in [-1, {MAX_INT32}] tokens (0 or -1 turn it off), "
                f"got {self.top_k!r}"
            )
        if self.max_tokens is not None and not (
            _is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_INT32
        ):
            raise ValueError(
                f"max_tokens: must be an int in [1, {MAX_INT32}] tokens or None, "
                f"got {self.max_tokens!r}"
            )
        if not (_is_int(self.min_tokens) and 0 <= self.min_tokens <= MAX_INT32):
            raise ValueError(
                f"min_tokens: must be an int in [0, {MAX_INT32}] tokens, got {self.min_tokens!r}"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens: must be <= max_tokens ({self.max_tokens} tokens), "
                f"got {self.min_tokens}"
            )

    def _check_floats(self) -> None:
        ranges = (
            ("temperature", lambda v: v >= 0.0, "[0, inf)"),
            ("top_p", lambda v: 0.0 < v <= 1.0, "(0, 1]"),
            ("min_p", lambda v: 0.0 <= v <= 1.0, "[0, 1]"),
            ("presence_penalty", lambda v: -2.0 <= v <= 2.0, "[-2, 2]"),
            ("frequency_penalty", lambda v: -2.0 <= v <= 2.0, "[-2, 2]"),
            ("repetition_penalty", lambda v: v > 0.0, "(0, inf)"),
        )
        for name, in_range, shown in ranges:
            value = getattr(self, name)
            # isfinite first: NaN and inf fail here rather than slipping through a comparison.
            if not (_is_number(value) and math.isfinite(value) and in_range(value)):
                raise ValueError(f"{name}: must be a finite number in {shown}, got {value!r}")
            if value != 0 and not FLOAT32_TINY <= abs(value) <= FLOAT32_MAX:
                raise ValueError(
                    f"{name}: {value!r} does not fit float32, which the sampler computes in "
                    f"(0 or a magnitude in [{FLOAT32_TINY:.3g}, {FLOAT32_MAX:.3g}])"
                )
            setattr(self, name, float(value))

    def _check_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name}: must be an int in [0, {MAX_LOGPROBS}] top tokens or None, "
                    f"got {value!r}"
                )

    def _normalize_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError(
                f"logit_bias: must be a dict of token id -> bias, got {self.logit_bias!r}"
            )
        clamped: dict[int, float] = {}
        for token_id, bias in self.logit_bias.items():
            if not (_is_int(token_id) and 0 <= token_id <= MAX_INT32):
                raise ValueError(
                    f"logit_bias: keys must be token ids (ints >= 0, at most {MAX_INT32}), "
                    f"got key {token_id!r}"
                )
            if not (_is_number(bias) and math.isfinite(bias)):
                raise ValueError(
                    f"logit_bias: value for token {token_id} must be a finite number, got {bias!r}"
                )
            clamped[token_id] = min(max(float(bias), -MAX_ABS_LOGIT_BIAS), MAX_ABS_LOGIT_BIAS)
        self.logit_bias = clamped

    @property
    def is_greedy(self) -> bool:
        """True when the request decodes with argmax (temperature below 1e-5)."""
        return self.temperature < GREEDY_TEMPERATURE

    def clone(self) -> SamplingParams:
        """A deep copy: changing the copy's lists or dict leaves this one alone."""
        return copy.deepcopy(self)

    def all_stop_token_ids(self, eos_token_ids: int | Iterable[int] | None) -> set[int]:
        """Token ids that end the request: EOS ids (unless ignore_eos) plus stop_token_ids."""
        stops = set(self.stop_token_ids or ())
        if self.ignore_eos or eos_token_ids is None:
            return stops
        if isinstance(eos_token_ids, int):
            return stops | {eos_token_ids}
        return stops | set(eos_token_ids)

    def check_token_ids(self, vocab_size: int) -> None:
        """Raises ValueError when a logit_bias or stop_token_ids id is outside the vocab."""
        for name, ids in (
            ("logit_bias", self.logit_bias or {}),
            ("stop_token_ids", self.stop_token_ids),
        ):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(
                    f"{name}: token ids must be < vocab size {vocab_size}, got {sorted(bad)[:8]}"
                )
