"""`LLM`: the offline API. `LLM(model=None, **engine_args).generate(prompts, params)`.

`model=None` runs the demo model. Requests are all added, then the engine is stepped
until they finish; outputs come back in the order of the prompts. A tqdm bar shows
progress and output-token throughput.

A model that takes images (LLaVA) takes them as vLLM's offline API does:

    llm.generate({"prompt": "USER: <image>\nWhat is this? ASSISTANT:",
                  "multi_modal_data": {"image": pil_image}})       # or a list, one per <image>
    llm.chat([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
        {"type": "image_pil", "image_pil": pil_image},              # or "image": pil_image
        {"type": "text", "text": "What is this?"}]}])

(`prompt_token_ids` with one image token per image works too.) The prompts' token ids
then hold each image's feature positions (RequestOutput.prompt_token_ids shows them).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.frontend.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from ringllm.pipeline.frontend.input_processor import ProcessedPrompt
from ringllm.pipeline.frontend.llm_engine import LLMEngine
from ringllm.pipeline.frontend.supervisor import DEFAULT_MAX_RESTARTS
from ringllm.pipeline.frontend.tokenizer import Tokenizer
from ringllm.pipeline.lora_request import LoRARequest
from ringllm.pipeline.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from ringllm.pipeline.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(
        self,
        model: str | None = None,
        log_stats: bool = False,
        multiprocess: bool = False,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
        **engine_args: Any,
    ) -> None:
        """`multiprocess`: the engine core runs in its own process behind the rings;
        `max_restarts`: deaths of that process (within a minute) that are restarted, its
        unfinished requests replayed (0: a death ends the engine)."""
        config = EngineConfig.from_kwargs(model=model, **engine_args)
        self._setup(config, log_stats, multiprocess, max_restarts)

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        log_stats: bool = False,
        multiprocess: bool = False,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
    ) -> LLM:
        llm = cls.__new__(cls)
        llm._setup(config, log_stats, multiprocess, max_restarts)
        return llm

    def _setup(
        self, config: EngineConfig, log_stats: bool, multiprocess: bool, max_restarts: int
    ) -> None:
        self.llm_engine = LLMEngine(
            config, log_stats=log_stats, multiprocess=multiprocess, max_restarts=max_restarts
        )
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> None:
        self.llm_engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Gives back the memory of the KV cache and the weights (`LLM(enable_sleep_mode=True)`):
        level 1 offloads the weights (to host memory on a GPU, to a temporary file on the
        CPU), level 2 drops them (read again from the model folder on wake). `generate`
        raises EngineSleepingError until `wake_up()`."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Weights and KV cache back; the outputs are those of an engine that never slept.
        `tags` (vLLM's): ["weights"] first, then ["kv_cache"], to keep the peak memory of
        waking low; the engine is awake once both are back."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads a PEFT adapter (`LLM(enable_lora=True)`); False if it is loaded already.
        `generate(..., lora_request=...)` loads it too when it is new."""
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.llm_engine.remove_lora(lora_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.llm_engine.list_loras()

    def shutdown(self) -> None:
        """Stops the engine core process (multiprocess mode); in-process: nothing to do."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: the LoRA adapter every prompt runs with, or one per prompt (None:
        the base model); adapters are loaded at their first use."""
        prompts = _as_prompt_list(prompts)
        params = _params_per_prompt(sampling_params, len(prompts))
        loras = _loras_per_prompt(lora_request, len(prompts))
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                request_id = str(next(self._ids))
                final = p.clone()
                final.output_kind = RequestOutputKind.FINAL_ONLY
                self.llm_engine.add_request(
                    request_id,
                    prompt,
                    final,
                    priority=priority[i] if priority else 0,
                    lora_request=loras[i],
                )
                ids.append(request_id)
        except ValueError:
            self.llm_engine.abort_request(ids)
            raise
        return self._run_engine(ids, use_tqdm)

    def embed(self, prompts: Any, use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Each prompt's vector, pooled as the model pools (pipeline/pooling.py: its
        --pooler-config or its sentence-transformers files); vLLM's `LLM.embed`. The
        prompts run in the engine's batches like any other. ValueError for a model that
        does not pool."""
        pooler = self.llm_engine.front_end.pooler_config
        if pooler is None:
            raise ValueError(
                "this model does not pool (embeddings): give it pooler_config='{\"pooling_type"
                '": "LAST"}\' (or MEAN, CLS; --pooler-config on the command line), or load an '
                "embedding model (a sentence-transformers folder)"
            )
        params = SamplingParams(
            max_tokens=1, pooling_type=pooler.pooling_type, pooling_normalize=pooler.normalize
        )
        outs = self.generate(prompts, params, use_tqdm=use_tqdm)
        return [
            EmbeddingRequestOutput(
                out.request_id, out.prompt_token_ids, EmbeddingOutput(out.pooled.tolist())
            )
            for out in outs
        ]

    def score(
        self, text_1: str | list[str], text_2: str | list[str], use_tqdm: bool = True
    ) -> list[ScoringRequestOutput]:
        """The cosine similarity of each pair's vectors (vLLM's `LLM.score` with an
        embedding model): one `text_1` against each `text_2`, or two lists pair by pair."""
        first = [text_1] if isinstance(text_1, str) else list(text_1)
        second = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second) or not second:
            raise ValueError(
                f"text_1: {len(first)} texts against text_2's {len(second)}; give one text_1, "
                "or as many as text_2"
            )
        unique = list(dict.fromkeys([*first, *second]))
        outs = dict(zip(unique, self.embed(unique, use_tqdm=use_tqdm), strict=True))
        results = []
        for a, b in zip(first, second, strict=True):
            u = np.asarray(outs[a].outputs.embedding, np.float64)
            v = np.asarray(outs[b].outputs.embedding, np.float64)
            score = float(u @ v / max(np.linalg.norm(u) * np.linalg.norm(v), 1e-12))
            ids = outs[a].prompt_token_ids + outs[b].prompt_token_ids
            results.append(ScoringRequestOutput(str(next(self._ids)), ids, ScoringOutput(score)))
        return results

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True
        )
        output_tokens = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    output_tokens += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
                    rate = bar.format_dict["rate"] or 0.0
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    bar.set_postfix_str(
                        f"output {output_tokens / elapsed:.1f} tok/s, {rate:.2f} req/s"
                    )
        bar.close()
        return [finished[i] for i in ids]

    def chat(
        self,
        messages: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations. `tools`:
        OpenAI's tool list, rendered by the chat template (a structured_outputs grammar in
        the params can then make the output a call: see the server's tool_choice). Image
        parts (a model that takes them): image_url (data:, or file: / http(s): as the
        multimodal flags allow), image_pil or image with a PIL image."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        front_end = self.llm_engine.front_end
        prompts = [
            front_end.chat_prompt(
                conversation,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                template_kwargs=chat_template_kwargs,
                tools=tools,
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: Any, params: BeamSearchParams) -> list[BeamSearchOutput]:
        return beam_search(self, _as_prompt_list(prompts), params)


def _as_prompt_list(prompts: Any) -> list:
    if isinstance(prompts, str | dict | ProcessedPrompt):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _params_per_prompt(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(
            f"sampling_params: {len(params)} given for {count} prompts; give one or one each"
        )
    return params


def _loras_per_prompt(lora_request, num_prompts: int) -> list:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(
            f"lora_request: {len(loras)} adapters for {num_prompts} prompts (give one, or "
            "one per prompt)"
        )
    return loras
