"""`FrontEnd`: everything between a user's prompt and an engine core's token ids, once.

    prompt / chat ─ process_prompt / chat_prompt ─> token ids ─ fan-out (n > 1) ─>
        EngineCoreRequest(s) ─ client.add_request ─> engine core
    engine core ─ CoreOutputs ─> process_outputs ─ detokenize, stop strings, n > 1 merge ─>
        RequestOutput(s)                      (stop strings found here abort in the core)

It holds the tokenizer, the chat template, the output processor, the core client
(pipeline/engine/core_client.py: inline, a thread, or other processes over the rings) and,
for a model that takes images, `images` (mm_prompt.py: the limit, the media policy, the
preprocessor and the media pool that loads a prompt's images).
`LLMEngine` (sync) and `AsyncLLM` (asyncio) are shells around it: they differ only in
how they wait for outputs, so the request path is written here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import uuid
from pathlib import Path
from typing import Any

from ringllm.pipeline.child_process import give_back_free_heap
from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.engine.core_client import CoreClient
from ringllm.pipeline.errors import too_long_message
from ringllm.pipeline.frontend.chat_template import ChatTemplate
from ringllm.pipeline.frontend.input_processor import (
    ProcessedPrompt,
    chat_prompt,
    check_max_tokens,
    fan_out,
    process_prompt,
)
from ringllm.pipeline.frontend.mm_prompt import PromptImages
from ringllm.pipeline.frontend.output_processor import OutputProcessor, ParentRequest
from ringllm.pipeline.frontend.stats import IterationStats
from ringllm.pipeline.frontend.tokenizer import Tokenizer
from ringllm.pipeline.frontend.tokenizer_process import OFFLOAD_CHARS, TokenizerProcess
from ringllm.pipeline.lora_request import LoraRegistry
from ringllm.pipeline.messages import CoreOutputs, EngineCoreRequest
from ringllm.pipeline.outputs import RequestOutput
from ringllm.pipeline.pooling import PoolerConfig, pooler_config_of
from ringllm.pipeline.sampling_params import SamplingParams
from ringllm.pipeline.stats import SpecDecodingStats
from ringllm.pipeline.structured.grammar import check_spec


def random_request_id(prefix: str = "req") -> str:
    """An id no other front end of the same engine will pick (vLLM's random_uuid)."""
    return f"{prefix}-{uuid.uuid4().hex}"


class FrontEnd:
    """`offload_tokenizing`: texts of OFFLOAD_CHARS or more are tokenized by a child process
    (pipeline/frontend/tokenizer_process.py), so that a thread pool serving an event loop
    never holds the GIL for long (AsyncLLM asks for it)."""

    def __init__(
        self, config: EngineConfig, client: CoreClient, offload_tokenizing: bool = False
    ) -> None:
        self.config = config
        self.client = client
        info = client.info
        self.info = info
        self.model_path = info.model_path
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.tokenizer = Tokenizer.from_folder(config.model.tokenizer or info.model_path)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids or info.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        # speculative decoding since the start: what the cores reported, summed
        self.spec_decoding = SpecDecodingStats() if config.speculative.enabled else None
        folder = config.model.tokenizer or info.model_path
        # a model that takes images: its preprocessor, loaded once (None: text only)
        self.images = PromptImages.for_model(
            info, self.tokenizer, config.multimodal, self.model_path
        )
        # how the model pools for embeddings (None: it does not; pipeline/pooling.py)
        self.pooler_config = pooler_config_of(self.model_path, config.model.pooler_config)
        self.loras = LoraRegistry()  # the adapters loaded in the engine (lora_request.py)
        if self.pooler_config is None and info.encoder_only:
            self.pooler_config = PoolerConfig("cls", True)  # an encoder's default, as vLLM's
        self._tokenizer_process = TokenizerProcess(folder) if offload_tokenizing else None
        # a GGUF's tokenizer is built from its metadata (the whole vocabulary as Python
        # objects, then dropped): that free heap given back (the worker does the same)
        give_back_free_heap()

    @functools.cached_property
    def matryoshka_dimensions(self) -> list[int] | None:
        """The shorter vectors the model was trained to give (`dimensions`): its config's
        matryoshka_dimensions ([] with is_matryoshka alone: any); None: none."""
        try:
            config = json.loads((Path(self.model_path) / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            return None
        dims = config.get("matryoshka_dimensions")
        if isinstance(dims, list) and all(isinstance(d, int) for d in dims):
            return dims
        return [] if config.get("is_matryoshka") is True else None

    @functools.cached_property
    def chat_template(self) -> ChatTemplate:
        return ChatTemplate.from_folder(
            self.config.model.tokenizer or self.model_path, self.config.model.chat_template
        )

    # ---- prompts ---------------------------------------------------------------------

    def process_prompt(self, prompt: Any) -> ProcessedPrompt:
        """Text, token ids, or {"prompt": ...} / {"prompt_token_ids": ...} -> token ids;
        either dict with "multi_modal_data": {"image": ...} for a model that takes images.

        A text that cannot fit the context whatever it says is refused before it is
        tokenized (tokenizing 12 MB costs seconds). Blocking (images are loaded, on the
        media pool): callers on an event loop run it on a thread."""
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if isinstance(text, str):
            self.check_text_fits(text, "prompt")
        return process_prompt(
            prompt, functools.partial(self.encode, field="prompt"), self.vocab_size, self.images
        )

    def encode(
        self, text: str, add_special_tokens: bool = True, field: str = "prompt"
    ) -> list[int]:
        """Token ids of `text`; a long one through the tokenizer process (when offloading),
        which says only the count of a text past the context: refused here with it."""
        if self._tokenizer_process is None or len(text) < OFFLOAD_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        count, ids = self._tokenizer_process.encode(text, add_special_tokens, self.max_model_len)
        if ids is None:
            raise ValueError(too_long_message(field, count, self.max_model_len))
        return ids

    def check_text_fits(self, text: str, field: str) -> None:
        """ValueError when `text` has more characters than max_model_len tokens can hold."""
        most = self.max_model_len * self.tokenizer.max_token_chars
        if len(text) > most:
            raise ValueError(
                f"{field}: {len(text)} characters cannot fit in this model's context of "
                f"{self.max_model_len} tokens (one token here stands for at most "
                f"{self.tokenizer.max_token_chars} characters); shorten it"
            )

    def chat_prompt(
        self,
        messages: list[Any],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
        load_images: bool = True,
    ) -> ProcessedPrompt:
        """A conversation through the chat template, then tokenized (no second BOS).
        Refused before tokenizing when its text cannot fit the context. `tools`: OpenAI's
        tool list, which the template renders (the model learns what it may call). Image
        parts (a model that takes them) are loaded on the media pool, last; blocking.
        `load_images` False: the expanded token ids only, no image read (/tokenize)."""
        return chat_prompt(
            self.chat_template,
            functools.partial(self.encode, field="messages"),
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
            add_special_tokens=add_special_tokens,
            check_text=lambda text: self.check_text_fits(text, "messages"),
            tools=tools,
            images=self.images,
            load_images=load_images,
        )

    # ---- requests --------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        strict_max_tokens: bool = False,
        group_id: str = "",
    ) -> None:
        """Admits a user request (its n children), or raises ValueError with nothing admitted.

        `prompt` may be a `ProcessedPrompt` already. `strict_max_tokens`: the online APIs'
        rule, an explicit max_tokens past the context is refused rather than capped.
        `group_id`: what the scheduler's fair share counts this request under (default: the
        request itself, all its n children together)."""
        if (
            request_id in self.output_processor.states
            or request_id in self.output_processor.parents
        ):
            raise ValueError(f"request_id: {request_id!r} is already in use")
        processed = prompt if isinstance(prompt, ProcessedPrompt) else self.process_prompt(prompt)
        params.check_token_ids(self.vocab_size)
        check_structured_outputs(params)
        if self.info.encoder_only and params.pooling_type is None:
            raise ValueError(
                f"model: {self.model_path.name} is an encoder: it gives embeddings only "
                "(/v1/embeddings, /score, /rerank; LLM.embed), it does not generate text"
            )
        cache_salt = processed.cache_salt
        if params.lora_id:  # never the blocks of another adapter or of the base model
            cache_salt = self.loras.salt(params.lora_id, cache_salt)
        if params.pooling_type is not None and self.pooler_config is None:
            raise ValueError(
                f"pooling_type: model {self.model_path.name} does not pool (embeddings); give "
                'it --pooler-config \'{"pooling_type": "LAST"}\' (or MEAN, CLS), or serve an '
                "embedding model (a sentence-transformers folder)"
            )
        # (a prompt that fills the context alone is the client's admission check to name)
        if strict_max_tokens and len(processed.token_ids) < self.max_model_len:
            check_max_tokens(len(processed.token_ids), params.max_tokens, self.max_model_len)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        parent = ParentRequest(request_id, params.n) if params.n > 1 else None
        sent: list[str] = []
        try:
            for index, (child_id, child_params) in enumerate(fan_out(request_id, params)):
                core_request = EngineCoreRequest(
                    child_id,
                    processed.token_ids,
                    child_params,
                    self.eos_token_ids,
                    arrival,
                    priority,
                    group_id or request_id,
                    mm_inputs=processed.mm_inputs,
                    cache_salt=cache_salt,
                )
                self.client.add_request(core_request)
                sent.append(child_id)
                self.output_processor.add_request(
                    child_id,
                    processed.text,
                    processed.token_ids,
                    child_params,
                    arrival,
                    parent=parent,
                    index=index,
                    core_request=core_request,
                )
        except BaseException:
            if sent:
                self.client.abort_requests(sent)
            self.output_processor.abort([request_id])
            raise

    def abort(self, request_ids: list[str], in_core: bool = True) -> None:
        """Forgets user requests; `in_core`: and aborts their sequences in the engine core."""
        core_ids = [c for rid in request_ids for c in self.output_processor.child_ids(rid)]
        self.output_processor.abort(list(request_ids))
        if core_ids and in_core:
            self.client.abort_requests(core_ids)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.output_processor.states)

    # ---- outputs ---------------------------------------------------------------------

    def process_outputs(self, batch: CoreOutputs) -> tuple[list[RequestOutput], IterationStats]:
        """A core batch -> the user outputs it completes; stop strings abort in the core."""
        stats = IterationStats()
        if self.spec_decoding is not None and batch.stats is not None:
            if batch.stats.spec_decoding is not None:
                self.spec_decoding.add(batch.stats.spec_decoding)
        outputs, to_abort = self.output_processor.process_outputs(batch.outputs, stats)
        if to_abort:
            self.client.abort_requests(to_abort)
        else:
            self.client.flush_aborts()
        return outputs, stats

    def reset_prefix_cache(self) -> None:
        self.client.reset_prefix_cache()

    def restore_loras(self, client) -> None:
        """A new engine core (after a restart) loads the adapters the old one held, before
        any replayed request that names one (the request ring keeps the order)."""
        for entry in self.loras.by_id.values():
            request = entry.request
            client.control("add_lora", request.lora_int_id, text=self.loras.control_text(request))

    def replay_requests(self) -> list[EngineCoreRequest]:
        """After the core died: every unfinished sequence as a new core should get it, its
        prompt plus the tokens this front end already has and what is left of its budget,
        so its output goes on where it stopped.

        Exact for greedy requests. Seeded sampling goes on from a seed derived from the
        request's seed and its length (deterministic, but not the tokens an undisturbed run
        would draw), and presence / frequency penalties then count the replayed tokens as
        prompt, not output."""
        replays = []
        for state in self.output_processor.states.values():
            request = state.core_request
            if request is None:
                continue
            replays.append(
                dataclasses.replace(
                    request,
                    prompt_token_ids=list(request.prompt_token_ids) + list(state.token_ids),
                    sampling_params=remaining_params(request.sampling_params, len(state.token_ids)),
                )
            )
        return replays

    def shutdown(self) -> None:
        if self._tokenizer_process is not None:
            self._tokenizer_process.close()
        if self.images is not None:
            self.images.shutdown()
        self.client.shutdown()


def check_structured_outputs(params: SamplingParams) -> None:
    """ValueError (a 400) if the request's structured-output spec cannot be enforced: not a
    JSON Schema, a regex or grammar that does not compile (cached: a spec costs once)."""
    if params.structured_outputs is not None:
        check_spec(*params.structured_outputs.spec())


def remaining_params(params: SamplingParams, num_done: int) -> SamplingParams:
    """What is left of a sequence's budget once `num_done` tokens of it were delivered."""
    if num_done == 0:
        return params
    changes: dict[str, Any] = {"prompt_logprobs": None}  # delivered with the first output
    if params.max_tokens is not None:
        changes["max_tokens"] = max(1, params.max_tokens - num_done)
    if params.min_tokens:
        changes["min_tokens"] = max(0, params.min_tokens - num_done)
    if params.seed is not None:
        changes["seed"] = (params.seed + num_done) % (1 << 63)  # within every seed range
    if params.structured_outputs is not None:  # its matcher consumes what was delivered
        changes["structured_outputs"] = dataclasses.replace(
            params.structured_outputs,
            num_prefix_tokens=params.structured_outputs.num_prefix_tokens + num_done,
        )
    return dataclasses.replace(params, **changes)
