"""POST /v1/embeddings (OpenAI's shape), /pooling, /score and /rerank (vLLM's; /rerank in
Jina's and Cohere's shape), for a model that pools.

    {"model", "input": str | [str] | [int] | [[int]], "encoding_format": "float" | "base64",
     "dimensions": int, "user", "truncate_prompt_tokens": int, "add_special_tokens": bool}
    -> {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": ...}],
        "model", "usage": {"prompt_tokens", "total_tokens"}}

Each input is one engine request (pipeline/pooling.py): its prompt computed, its vector
pooled by the worker, no token sampled; they run in the same batches as generation
requests. base64 is the float32 vector's little-endian bytes (what the `openai` client
decodes). `dimensions` keeps the first N values (renormalized) and is taken only from a
model trained for it (a Matryoshka model: `matryoshka_dimensions` or `is_matryoshka` in
its config.json); other models: a 400, as in vLLM. A model that does not pool: a 400 that
says how to make it pool (--pooler-config).

A score is the cosine similarity of the two texts' vectors (a bi-encoder, as vLLM scores
with an embedding model); each distinct text is pooled once per request.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ringllm.pipeline.pooling import PoolerConfig
from ringllm.pipeline.sampling_params import RequestOutputKind, SamplingParams
from ringllm.server.engine_requests import MergedGenerations
from ringllm.server.errors import ApiError, invalid_value
from ringllm.server.responses import new_id
from ringllm.server.tokenization import known_fields

if TYPE_CHECKING:
    from ringllm.server.serving import Serving

_FIELDS = {
    "model",
    "input",
    "encoding_format",
    "dimensions",
    "user",
    "truncate_prompt_tokens",
    "add_special_tokens",
}
MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request


async def create_embeddings(serving: Serving, body: Any) -> dict:
    pooler = _pooler_or_400(serving)
    body = known_fields(body, _FIELDS)
    inputs = _inputs(body.get("input"))
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise ApiError(
            f"encoding_format: must be 'float' or 'base64', got {encoding!r}",
            param="encoding_format",
        )
    dimensions = _dimensions(body.get("dimensions"), serving)
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None and not (
        isinstance(truncate, int) and not isinstance(truncate, bool) and truncate >= 1
    ):
        raise ApiError(
            f"truncate_prompt_tokens: must be an int >= 1 tokens, got {truncate!r}",
            param="truncate_prompt_tokens",
        )
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise ApiError(
            f"add_special_tokens: must be a JSON boolean, got {add_special!r}",
            param="add_special_tokens",
        )
    prompts = [await _prompt(serving, item, add_special, truncate) for item in inputs]
    vectors, num_tokens = await pool(serving, prompts, pooler)
    data = []
    for index, vector in enumerate(vectors):
        if dimensions is not None:
            vector = vector[:dimensions]
            if pooler.normalize:
                vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        data.append({"object": "embedding", "index": index, "embedding": _encode(vector, encoding)})
    return {
        "id": new_id("embd"),
        "object": "list",
        "created": int(time.time()),
        "data": data,
        "model": serving.model_name,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


async def pool(
    serving: Serving, prompts: list[Any], pooler: PoolerConfig
) -> tuple[list[np.ndarray], int]:
    """The pooled vector of each prompt (float32), and their prompt tokens together."""
    params = SamplingParams(
        max_tokens=1,
        pooling_type=pooler.pooling_type,
        pooling_normalize=pooler.normalize,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    generations = MergedGenerations(serving.llm, prompts, params, new_id("embd"))
    vectors: list[np.ndarray | None] = [None] * len(prompts)
    num_tokens = 0
    try:
        async for index, out in generations.outputs():
            if out.finished:
                vectors[index] = out.pooled
                num_tokens += len(out.prompt_token_ids)
    except ValueError as exc:  # refused as given: a prompt over the context, a bad token
        raise invalid_value(exc, {"prompt": "input"}) from None
    finally:
        await generations.close()
    return vectors, num_tokens


def _pooler_or_400(serving: Serving) -> PoolerConfig:
    pooler = serving.llm.pooler_config
    if pooler is None:
        raise ApiError(
            f"model {serving.model_name!r} does not pool: it serves generation only. Start it "
            'with --pooler-config \'{"pooling_type": "LAST", "normalize": true}\' (or MEAN '
            "/ CLS), or serve an embedding model (a sentence-transformers folder)",
            param="model",
            code="model_does_not_pool",
        )
    return pooler


def _inputs(given: Any) -> list[str | list[int]]:
    """OpenAI's `input`: a string, a list of strings, a token list, or a list of those."""
    if isinstance(given, str):
        items = [given]
    elif isinstance(given, list) and given and all(_is_token(t) for t in given):
        items = [given]
    elif isinstance(given, list) and given:
        items = given
    else:
        raise ApiError(
            "input: must be a non-empty string, list of strings, token list or list of token "
            f"lists, got {json.dumps(given)[:80]}",
            param="input",
        )
    if len(items) > MAX_INPUTS:
        raise ApiError(f"input: at most {MAX_INPUTS} inputs, got {len(items)}", param="input")
    for item in items:
        ok = (isinstance(item, str) and item) or (
            isinstance(item, list) and item and all(_is_token(t) for t in item)
        )
        if not ok:
            raise ApiError(
                "input: each input must be a non-empty string or a non-empty list of token "
                f"ids, got {json.dumps(item)[:80]}",
                param="input",
            )
    return items


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def _prompt(serving: Serving, item, add_special: bool, truncate: int | None):
    """What the engine takes: a text as it is (tokenized off the loop by AsyncLLM), or
    token ids (a text tokenized here, on a worker thread, to cut or leave out specials)."""
    if isinstance(item, str) and add_special and truncate is None:
        return item
    if isinstance(item, str):
        encode = serving.llm.front_end.encode
        loop = asyncio.get_running_loop()
        item = await loop.run_in_executor(None, encode, item, add_special)
    if truncate is not None:
        item = item[-truncate:]  # vLLM keeps the last tokens
    return {"prompt_token_ids": item}


def _dimensions(value: Any, serving: Serving) -> int | None:
    if value is None:
        return None
    if not _is_token(value) or value < 1:
        raise ApiError(f"dimensions: must be an int >= 1, got {value!r}", param="dimensions")
    allowed = serving.llm.front_end.matryoshka_dimensions
    if allowed is None:
        raise ApiError(
            f"dimensions: model {serving.model_name!r} was not trained for shorter vectors "
            "(no matryoshka_dimensions in its config); leave dimensions out",
            param="dimensions",
        )
    if allowed and value not in allowed:
        raise ApiError(
            f"dimensions: {value} is not one of the model's {sorted(allowed)}",
            param="dimensions",
        )
    return value


def _encode(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.ascontiguousarray(vector, "<f4").tobytes()).decode()
    return vector.tolist()


# ---- scores: the cosine similarity of two texts' vectors (a bi-encoder, as vLLM scores
# with an embedding model) --------------------------------------------------------------

_SCORE_FIELDS = {"model", "text_1", "text_2", "truncate_prompt_tokens", "user"}
_RERANK_FIELDS = {"model", "query", "documents", "top_n", "return_documents", "user"}


async def create_scores(serving: Serving, body: Any) -> dict:
    """/score (vLLM's): `text_1` one text against each of `text_2`, or two lists pair by
    pair -> {"data": [{"index", "object": "score", "score"}], "usage"}."""
    body = known_fields(body, _SCORE_FIELDS)
    first, second = _texts(body.get("text_1"), "text_1"), _texts(body.get("text_2"), "text_2")
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise ApiError(
            f"text_1: {len(first)} texts against text_2's {len(second)}; give one text_1, or "
            "as many as text_2",
            param="text_1",
        )
    scores, num_tokens = await _cosines(serving, first, second, body.get("truncate_prompt_tokens"))
    return {
        "id": new_id("score"),
        "object": "list",
        "created": int(time.time()),
        "model": serving.model_name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


async def create_rerank(serving: Serving, body: Any) -> dict:
    """/rerank (Jina's and Cohere's shape, as vLLM serves it): the documents by their
    score against the query, best first, `top_n` of them."""
    body = known_fields(body, _RERANK_FIELDS)
    query = _texts(body.get("query"), "query")
    if len(query) != 1:
        raise ApiError("query: must be one string", param="query")
    documents = body.get("documents")
    if isinstance(documents, list):
        documents = [d.get("text") if isinstance(d, dict) else d for d in documents]
    documents = _texts(documents, "documents")
    top_n = body.get("top_n", len(documents))
    if not _is_token(top_n) or top_n < 1:
        raise ApiError(f"top_n: must be an int >= 1, got {top_n!r}", param="top_n")
    return_documents = body.get("return_documents", True)
    if not isinstance(return_documents, bool):
        raise ApiError("return_documents: must be a JSON boolean", param="return_documents")
    scores, num_tokens = await _cosines(serving, query * len(documents), documents, None)
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": scores[i]}
        if return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return {
        "id": new_id("rerank"),
        "model": serving.model_name,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        "results": results,
    }


async def _cosines(serving, first: list[str], second: list[str], truncate) -> tuple[list, int]:
    pooler = _pooler_or_400(serving)
    unique = list(dict.fromkeys([*first, *second]))  # each text pooled once
    prompts = [await _prompt(serving, text, True, truncate) for text in unique]
    vectors, num_tokens = await pool(serving, prompts, pooler)
    by_text = dict(zip(unique, vectors, strict=True))
    scores = []
    for a, b in zip(first, second, strict=True):
        u, v = by_text[a].astype(np.float64), by_text[b].astype(np.float64)
        scores.append(float(u @ v / max(np.linalg.norm(u) * np.linalg.norm(v), 1e-12)))
    return scores, num_tokens


def _texts(given: Any, name: str) -> list[str]:
    items = [given] if isinstance(given, str) else given
    if not (isinstance(items, list) and items and all(isinstance(t, str) and t for t in items)):
        raise ApiError(
            f"{name}: must be a non-empty string or a non-empty list of them, got "
            f"{json.dumps(given)[:80]}",
            param=name,
        )
    if len(items) > MAX_INPUTS:
        raise ApiError(f"{name}: at most {MAX_INPUTS} texts, got {len(items)}", param=name)
    return items
