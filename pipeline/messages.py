"""The messages between a front end and an engine core, and what an engine says of itself.

    front end ── EngineCoreRequest ──> engine core        (in process: the object; over the
    front end <── CoreOutputs (EngineCoreOutput...) ──     rings: pipeline/engine/records.py)

Token ids only: text lives in the front end. `EngineInfo` is what a front end needs to
know about the engine it talks to; it crosses the instance segment as JSON (`to_json` /
`from_json`, the one codec of it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ringllm.pipeline.sampling_params import SamplingParams
from ringllm.pipeline.stats import SchedulerStats


@dataclass
class LogprobRow:
    """Top-N logprobs of one position: column 0 is the chosen token."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # 1-based rank of the chosen token


IMAGE_HASH_BYTES = 16


def image_hash(pixel_values: np.ndarray) -> bytes:
    """The content hash of a preprocessed image: its dtype, shape and bytes (blake2b, 16
    bytes). Two images with the same pixel values after preprocessing share KV; any other
    two never do (the hash is part of the prefix cache's block hashes)."""
    digest = hashlib.blake2b(digest_size=IMAGE_HASH_BYTES)
    digest.update(f"{pixel_values.dtype.str}{pixel_values.shape}".encode())
    digest.update(np.ascontiguousarray(pixel_values).data)
    return digest.digest()


CACHE_SALT_BYTES = 16


def cache_salt_digest(salt: str) -> bytes:
    """What a request's `cache_salt` becomes for the engine: 16 bytes of BLAKE2b (fixed
    size, so the request records carry it as a field; b"": no salt). It keys the first
    block's hash, and so every block of the request (core/kv_cache_manager.py)."""
    return hashlib.blake2b(
        salt.encode("utf-8", "surrogatepass"), digest_size=CACHE_SALT_BYTES
    ).digest()


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt: where its placeholder positions are and its pixels.

    `offset`: the first of its `length` positions in the prompt's token ids (each holds the
    model's image token); `pixel_values`: float32 [3, H, W] as the model's
    preprocessor_config.json makes them (None once the engine holds them elsewhere);
    `hash`: `image_hash(pixel_values)`."""

    offset: int
    length: int
    hash: bytes
    pixel_values: np.ndarray | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_pixels(cls, offset: int, length: int, pixel_values: np.ndarray) -> ImageInput:
        pixels = np.ascontiguousarray(pixel_values, dtype=np.float32)
        return cls(offset, length, image_hash(pixels), pixels)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class EngineCoreRequest:
    """One sequence for the engine core to run: what a front end sends (after n > 1 fan-out,
    one per child). The core builds its own `Request` state from it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    arrival_time: float
    priority: int = 0
    # The user request this sequence belongs to (the n children of one request, the prompts
    # of one HTTP request), for the scheduler's fair share; "" means its own id.
    group_id: str = ""
    # The prompt's images, in position order (a multimodal model's; () for text).
    mm_inputs: tuple[ImageInput, ...] = ()
    # `cache_salt_digest` of the request's cache_salt (b"": none): only requests with the
    # same salt share prefix-cache blocks (vLLM's tenant isolation)
    cache_salt: bytes = b""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def group(self) -> str:
        return self.group_id or self.request_id


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobRow] | None = None
    new_prompt_logprobs: list[LogprobRow] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    queued_s: float | None = None  # arrival -> first scheduled, on a request's first output
    # With finish_reason "error": what went wrong. `refused`: the core would not take the
    # request as given (the client's mistake); else it failed while computing it (the
    # engine's: the cause is in the engine's log, `error` says only that it failed).
    error: str | None = None
    refused: bool = False
    # a pooling request's vector (float32), on its last output (pipeline/pooling.py)
    pooled: np.ndarray | None = field(default=None, compare=False, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# Sleep mode: the levels sleep(level) takes (pipeline/worker/sleep.py says what each frees),
# and what wake_up(tags) may bring back, one part at a time (vLLM's tags).
SLEEP_LEVELS = (1, 2)
WAKE_TAGS = ("weights", "kv_cache")


def wake_bits(tags) -> int:
    """Tags as the bits a control record carries (bit i: WAKE_TAGS[i]; 0: all of them)."""
    if not tags:
        return 0
    unknown = set(tags) - set(WAKE_TAGS)
    if unknown:
        raise ValueError(f"wake_up tags: {sorted(unknown)} are not among {WAKE_TAGS}")
    return sum(1 << WAKE_TAGS.index(tag) for tag in set(tags))


def wake_tags(bits: int) -> list[str]:
    return [tag for i, tag in enumerate(WAKE_TAGS) if not bits or bits >> i & 1]


@dataclass(frozen=True)
class ControlReply:
    """A core's answer to a control command (sleep, wake_up): the command's ticket (what the
    client's `control` returned), the core's sleep level after it, and the error, if any."""

    ticket: int
    sleep_level: int
    error: str | None = None


@dataclass
class CoreOutputs:
    """One batch of outputs from a core (a step's), with its stats when it sent them, and
    the answers to control commands that came with it."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    stats: SchedulerStats | None = None
    replies: list[ControlReply] = field(default_factory=list)


@dataclass(frozen=True)
class EngineInfo:
    """What a front end needs to know about the engine core it talks to."""

    model_path: Path
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    eos_token_ids: tuple[int, ...]
    # A model that takes images: the token its prompts hold at each image feature position,
    # and how many positions one image fills (-1 / 0: a text-only model).
    image_token_id: int = -1
    num_image_tokens: int = 0
    image_size: int = 0  # pixels per side of the images its vision encoder takes
    # tokens one request can hold in the whole KV cache where that is not
    # num_blocks * block_size (sliding-window layers freeing blocks); 0: it is
    max_request_tokens: int = 0
    # an encoder (models/bert.py): it takes pooling requests only (pipeline/pooling.py)
    encoder_only: bool = False

    @property
    def takes_images(self) -> bool:
        return self.num_image_tokens > 0

    def to_json(self) -> dict:
        values = dataclasses.asdict(self)
        values["model_path"] = str(self.model_path)
        values["eos_token_ids"] = list(self.eos_token_ids)
        return values

    @classmethod
    def from_json(cls, values: dict) -> EngineInfo:
        names = {f.name for f in dataclasses.fields(cls)}
        missing = names - set(values)
        if missing:
            raise ValueError(f"engine info: missing {sorted(missing)} in {json.dumps(values)}")
        return cls(
            model_path=Path(values["model_path"]),
            max_model_len=int(values["max_model_len"]),
            vocab_size=int(values["vocab_size"]),
            num_blocks=int(values["num_blocks"]),
            block_size=int(values["block_size"]),
            eos_token_ids=tuple(int(t) for t in values["eos_token_ids"]),
            image_token_id=int(values["image_token_id"]),
            num_image_tokens=int(values["num_image_tokens"]),
            image_size=int(values["image_size"]),
            max_request_tokens=int(values["max_request_tokens"]),
            encoder_only=bool(values["encoder_only"]),
        )
