"""Pooling (pipeline/pooling.py, worker/pooler.py): `LLM.embed` against transformers' final
hidden states of the same model, for each pooling type, through chunked prefill, prefix
caching and preemption; the pooling fields over every ring's codec; how a model's folder
says it pools."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModel

from ringllm.pipeline import LLM, SamplingParams, wire
from ringllm.pipeline.core.scheduler_output import ModelRunnerOutput
from ringllm.pipeline.engine import records
from ringllm.pipeline.executor import batch_records
from ringllm.pipeline.messages import EngineCoreOutput
from ringllm.pipeline.pooling import PoolerConfig, parse_pooler_config, pooler_config_of

ENGINE = {"dtype": "float32", "max_model_len": 256, "num_gpu_blocks_override": 128}


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 200, size=length - i).tolist() for i in range(count)]


def reference(path, ids: list[int], kind: str, normalize: bool) -> np.ndarray:
    """transformers' final hidden states (after the last norm) of `ids`, pooled."""
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0].double()
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[kind]
    if normalize:
        vector = vector / vector.norm()
    return vector.numpy()


@pytest.fixture(scope="module")
def path(model_factory):
    return model_factory("llama")


@pytest.mark.parametrize(
    "kind,normalize", [("last", True), ("mean", True), ("cls", False), ("mean", False)]
)
def test_embed_matches_transformers_hidden_states(path, kind, normalize):
    config = json.dumps({"pooling_type": kind.upper(), "normalize": normalize})
    # 16 tokens a step: the 40-token prompts take three chunks each
    llm = LLM(str(path), pooler_config=config, max_num_batched_tokens=16, **ENGINE)
    try:
        batch = prompts(3, 40)
        outs = llm.embed([{"prompt_token_ids": p} for p in batch], use_tqdm=False)
        for ids, out in zip(batch, outs, strict=True):
            assert out.prompt_token_ids == ids and out.finished
            got = np.asarray(out.outputs.embedding)
            np.testing.assert_allclose(got, reference(path, ids, kind, normalize), atol=1e-4)
    finally:
        llm.shutdown()


def test_embed_beside_generation_prefix_caching_and_preemption(path):
    """Pooling requests in the same batches as generations, in a cache too small for all
    of them (they preempt each other), the same prompt pooled again after its blocks were
    cached: mean pooling never starts from a cached prefix (it needs every position), last
    pooling may. Vectors and greedy tokens are those of runs alone."""
    ids = prompts(1, 48)[0]
    expected = {kind: reference(path, ids, kind, True) for kind in ("last", "mean")}
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    gen_prompts = [{"prompt_token_ids": ids[k : k + 20 + k]} for k in range(4)]
    alone = LLM(str(path), **ENGINE)
    try:
        want = [o.outputs[0].token_ids for o in alone.generate(gen_prompts, greedy, use_tqdm=False)]
    finally:
        alone.shutdown()
    for kind in ("last", "mean"):
        # 10 blocks of 16: four generations of 60-66 tokens preempt each other, and the
        # three 48-token prompts that came last (the first to go)
        llm = LLM(
            str(path), pooler_config=json.dumps({"pooling_type": kind}),
            dtype="float32", max_model_len=256, num_gpu_blocks_override=10,
            max_num_batched_tokens=16, preemption_mode="recompute",
        )  # fmt: skip
        try:
            first = llm.embed([{"prompt_token_ids": ids}], use_tqdm=False)[0]
            pool = SamplingParams(max_tokens=1, pooling_type=kind)
            mixed = gen_prompts + [{"prompt_token_ids": ids}] * 3
            outs = llm.generate(mixed, [greedy] * 4 + [pool] * 3, use_tqdm=False)
            for vector in [first.outputs.embedding] + [o.pooled for o in outs[4:]]:
                np.testing.assert_allclose(vector, expected[kind], atol=1e-4)
            assert all(o.outputs[0].token_ids == [] for o in outs[4:])
            assert [o.outputs[0].token_ids for o in outs[:4]] == want
            assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
        finally:
            llm.shutdown()


def test_a_model_that_does_not_pool_refuses_embed(path):
    llm = LLM(str(path), **ENGINE)
    try:
        with pytest.raises(ValueError, match="does not pool.*--pooler-config"):
            llm.embed(["hello"], use_tqdm=False)
    finally:
        llm.shutdown()


def test_pooling_fields_cross_the_rings():
    params = SamplingParams(max_tokens=1, pooling_type="mean", pooling_normalize=False)
    decoded = wire.decode_sampling(wire.sampling_values(params), wire.sampling_ints(params))
    assert (decoded.pooling_type, decoded.pooling_normalize) == ("mean", False)
    plain = wire.decode_sampling(
        wire.sampling_values(SamplingParams()), wire.sampling_ints(SamplingParams())
    )
    assert plain.pooling_type is None
    vector = np.linspace(-1, 1, 37, dtype=np.float32)
    # the output ring (core -> front end)
    out = EngineCoreOutput("r", [], finish_reason="stop", pooled=vector)
    recs, blobs = records.encode_outputs([7], [out])
    pooled = records.decode_blob(blobs[0]).pooled
    np.testing.assert_array_equal(pooled, vector)
    # the result ring (rank 0 -> core)
    result = ModelRunnerOutput(["a", "b"], [None, 3], [None, None], pooled={"a": vector})
    record, blob = batch_records.encode_output(result)
    back = batch_records.decode_output(record[0], blob, ["a", "b"])
    np.testing.assert_array_equal(back.pooled["a"], vector)
    assert "b" not in back.pooled and back.sampled_token_ids == [None, 3]


def test_pooling_config_from_flags_and_sentence_transformers_files(tmp_path):
    assert parse_pooler_config('{"pooling_type": "MEAN"}') == PoolerConfig("mean", True)
    assert parse_pooler_config('{"pooling_type": "cls", "normalize": false}') == PoolerConfig(
        "cls", False
    )
    for bad, match in (
        ("nope", "not JSON"),
        ("[1]", "JSON object"),
        ('{"pooling_type": "MAX"}', "not one of LAST, MEAN, CLS"),
        ('{"pooling": "MEAN"}', "unknown keys"),
        ('{"normalize": 1}', "true or false"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_pooler_config(bad)
    assert pooler_config_of(tmp_path) is None  # no modules.json: no pooling
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    mode = {"word_embedding_dimension": 8, "pooling_mode_mean_tokens": True}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(mode))
    assert pooler_config_of(tmp_path) == PoolerConfig("mean", True)
    assert pooler_config_of(tmp_path, '{"pooling_type": "LAST"}') == PoolerConfig("last", True)
    mode["pooling_mode_cls_token"] = True
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(mode))
    with pytest.raises(ValueError, match="exactly one of"):
        pooler_config_of(tmp_path)


def test_score_is_the_cosine_of_the_two_vectors(path):
    llm = LLM(str(path), pooler_config='{"pooling_type": "MEAN", "normalize": false}', **ENGINE)
    try:
        texts = ["a cat", "a dog", "the stock market"]
        vectors = [np.asarray(o.outputs.embedding) for o in llm.embed(texts, use_tqdm=False)]
        scores = llm.score(texts[0], texts, use_tqdm=False)
        for vector, out in zip(vectors, scores, strict=True):
            cosine = vectors[0] @ vector / (np.linalg.norm(vectors[0]) * np.linalg.norm(vector))
            assert out.outputs.score == pytest.approx(cosine, abs=1e-6)
        pairs = llm.score(texts[:2], texts[1:], use_tqdm=False)
        assert len(pairs) == 2 and pairs[0].outputs.score == pytest.approx(scores[1].outputs.score)
        with pytest.raises(ValueError, match="give one text_1"):
            llm.score(texts[:2], texts, use_tqdm=False)
    finally:
        llm.shutdown()


def test_vectors_are_the_same_in_process_over_the_rings_and_over_the_tp_ranks(path):
    """The output ring (a core process) and the batch and result rings (TP=2) carry the
    pooling fields and the vectors."""
    args = dict(model=str(path), pooler_config='{"pooling_type": "MEAN"}', **ENGINE)
    batch = [{"prompt_token_ids": p} for p in prompts(3, 30, seed=3)]

    def vectors(llm: LLM) -> np.ndarray:
        with llm:
            return np.array([o.outputs.embedding for o in llm.embed(batch, use_tqdm=False)])

    in_process = vectors(LLM(**args))
    np.testing.assert_allclose(vectors(LLM(multiprocess=True, **args)), in_process, atol=1e-6)
    np.testing.assert_allclose(vectors(LLM(tensor_parallel_size=2, **args)), in_process, atol=1e-5)
