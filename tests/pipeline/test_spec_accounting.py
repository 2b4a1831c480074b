"""Exact accounting under speculative decoding: wherever a request stops inside an accepted
run (a stop string, a stop token id, max_tokens, EOS), its token ids, logprobs, finish and
stop reasons and the generation-token count are those of the same request without
speculation, with n-gram drafts and with a draft model, n = 1 or 2.

The target model is made to repeat: a random tiny model whose head makes each token of a
fixed cycle of 16 printable tokens predict the next one, so greedy output walks the cycle and
drafts are accepted in long runs (the n-gram proposer after one lap, the draft model at
once), and an EOS id (one token of the cycle) comes at a place set by where the prompt ends.
The draft model is the target cut to one layer with three links of the cycle broken, so its
runs also end in rejections.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from ringllm.pipeline import LLM, SamplingParams
from ringllm.tools.make_model import ModelShape, make_draft, make_model

CYCLE_LENGTH = 16
MAX_TOKENS = 24
ENGINE = {"dtype": "float32", "max_num_seqs": 16, "num_gpu_blocks_override": 256}
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}


def _cycle_head(embed: torch.Tensor, cycle: list[int], links: range | list[int]) -> torch.Tensor:
    """An lm_head whose row for cycle[i + 1] is cycle[i]'s embedding, for each link i: after
    cycle[i] the next token is cycle[i + 1] (the final norm is made the identity)."""
    head = torch.zeros_like(embed)
    for i in links:
        head[cycle[(i + 1) % len(cycle)]] += embed[cycle[i]]
    return head * 0.4


def _rewrite(folder: Path, change) -> None:
    path = folder / "model.safetensors"
    weights = load_file(str(path))
    change(weights)
    save_file(weights, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def cycle_model(tmp_path_factory):
    """(target folder, draft folder, the cycle, the EOS id)."""
    root = tmp_path_factory.mktemp("cycle_model")
    target = make_model(root / "target", ModelShape(arch="llama", tie_word_embeddings=False))
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    printable = [
        t
        for t in range(3, tokenizer.get_vocab_size())
        if (text := tokenizer.decode([t])) and text.isascii() and text.isprintable()
    ]
    cycle = random.Random(0).sample(printable, CYCLE_LENGTH)

    def walk_the_cycle(weights):
        weights["lm_head.weight"] = _cycle_head(
            weights["model.embed_tokens.weight"], cycle, range(CYCLE_LENGTH)
        )
        weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
        for name in weights:  # the layers stay (attention reads the KV cache), but quieter
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                weights[name] = weights[name] * 0.3

    _rewrite(target, walk_the_cycle)
    eos_id = cycle[CYCLE_LENGTH // 2]
    generation_path = target / "generation_config.json"
    generation = json.loads(generation_path.read_text())
    generation["eos_token_id"] = [*generation["eos_token_id"], eos_id]
    generation_path.write_text(json.dumps(generation))

    draft = make_draft(root / "draft", target, num_layers=1)
    broken = [2, 7, 12]
    kept = [i for i in range(CYCLE_LENGTH) if i not in broken]

    def break_links(weights):
        head = _cycle_head(weights["model.embed_tokens.weight"], cycle, kept)
        for i in broken:  # after cycle[i] the draft guesses cycle[i + 2]
            head[cycle[(i + 2) % CYCLE_LENGTH]] += (
                weights["model.embed_tokens.weight"][cycle[i]] * 0.4
            )
        weights["lm_head.weight"] = head

    _rewrite(draft, break_links)
    return target, draft, cycle, eos_id


@pytest.fixture(scope="module")
def engines(cycle_model):
    target, draft, _, _ = cycle_model
    draft_config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}
    return {
        "plain": LLM(str(target), **ENGINE),
        "ngram": LLM(str(target), speculative_config=NGRAM, **ENGINE),
        "draft": LLM(str(target), speculative_config=draft_config, **ENGINE),
    }


@pytest.fixture(scope="module")
def generation_tokens(engines) -> dict[str, list[int]]:
    """Per engine, a running total of the generation tokens its front end's statistics
    counted (what /metrics and the stats log add up)."""
    totals = {}
    for name, llm in engines.items():
        front_end = llm.llm_engine.front_end
        total = totals[name] = [0]

        def counted(batch, process_outputs=front_end.process_outputs, total=total):
            outputs, stats = process_outputs(batch)
            total[0] += stats.num_generation_tokens
            return outputs, stats

        front_end.process_outputs = counted
    return totals


@st.composite
def requests(draw, cycle: list[int], tokenizer_decode):
    """(prompt, params): a prompt that ends somewhere on the cycle (after noise drawn from
    the cycle's tokens out of order, which n-gram drafts then follow wrongly), and any mix
    of a stop string, a stop token id, max_tokens and EOS, each at a random place in the
    output the cycle gives."""
    noise = draw(st.lists(st.sampled_from(cycle), max_size=8))
    start = draw(st.integers(0, CYCLE_LENGTH - 1))
    walked = draw(st.integers(1, 2 * CYCLE_LENGTH))
    prompt = noise + [cycle[(start + k) % CYCLE_LENGTH] for k in range(walked)]
    last = (start + walked - 1) % CYCLE_LENGTH
    expected = [cycle[(last + 1 + k) % CYCLE_LENGTH] for k in range(MAX_TOKENS)]
    kwargs = {
        "n": draw(st.sampled_from([1, 1, 2])),
        "temperature": 0.0,
        "logprobs": 2,
        "ignore_eos": draw(st.booleans()),
        "max_tokens": draw(st.integers(1, MAX_TOKENS)),
        "min_tokens": draw(st.sampled_from([0, 0, 0, 3])),
    }
    if draw(st.booleans()):
        text = tokenizer_decode(expected)
        begin = draw(st.integers(0, len(text) - 1))
        kwargs["stop"] = [text[begin : begin + draw(st.integers(1, 5))]]
        kwargs["include_stop_str_in_output"] = draw(st.booleans())
    if draw(st.booleans()):
        kwargs["stop_token_ids"] = [expected[draw(st.integers(0, MAX_TOKENS - 1))]]
    return prompt, SamplingParams(**kwargs)


def assert_same_outputs(want, got) -> None:
    for w, g in zip(want, got, strict=True):
        for wc, gc in zip(w.outputs, g.outputs, strict=True):
            assert list(gc.token_ids) == list(wc.token_ids)
            assert gc.text == wc.text
            assert (gc.finish_reason, gc.stop_reason) == (wc.finish_reason, wc.stop_reason)
            assert len(gc.logprobs) == len(wc.logprobs) == len(wc.token_ids)
            for wl, gl in zip(wc.logprobs, gc.logprobs, strict=True):
                assert gl.keys() == wl.keys()
                for token, lp in wl.items():
                    assert gl[token].logprob == pytest.approx(lp.logprob, abs=1e-4)
                    assert gl[token].rank == lp.rank
            assert gc.cumulative_logprob == pytest.approx(wc.cumulative_logprob, abs=1e-3)


@pytest.fixture(scope="module")
def decode(engines):
    tokenizer = engines["plain"].get_tokenizer()
    return lambda ids: tokenizer.decode(ids)


def test_the_made_model_walks_its_cycle_and_drafts_are_accepted_in_runs(engines, cycle_model):
    _, _, cycle, _ = cycle_model
    prompt = cycle[:5]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for name, llm in engines.items():
        ids = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert list(ids) == [cycle[(5 + k) % CYCLE_LENGTH] for k in range(MAX_TOKENS)], name
    for name in ("ngram", "draft"):
        counts = engines[name].llm_engine.front_end.spec_decoding
        assert counts.accepted_per_pos[-1] > 0, name  # whole runs of 4 drafts were accepted
    draft_counts = engines["draft"].llm_engine.front_end.spec_decoding
    assert draft_counts.num_accepted_tokens < draft_counts.num_draft_tokens  # broken links


# NOTE: no shrinking: each example costs three engines' generations, and a failure's
# example (the batch's prompts and params) is readable as it is.
@settings(max_examples=15, deadline=None, derandomize=True, phases=[Phase.generate])
@given(data=st.data())
def test_stops_inside_accepted_runs_account_as_without_speculation(
    engines, generation_tokens, cycle_model, decode, data
):
    """A batch of three random requests through each engine: every output and the count of
    generation tokens is that of plain decoding."""
    _, _, cycle, _ = cycle_model
    batch = [data.draw(requests(cycle, decode)) for _ in range(3)]
    prompts = [prompt for prompt, _ in batch]
    params = [p for _, p in batch]
    before = {name: total[0] for name, total in generation_tokens.items()}
    want = engines["plain"].generate(prompts, params, use_tqdm=False)
    num_kept = sum(len(c.token_ids) for o in want for c in o.outputs)
    assert generation_tokens["plain"][0] - before["plain"] == num_kept
    for name in ("ngram", "draft"):
        got = engines[name].generate(prompts, params, use_tqdm=False)
        assert_same_outputs(want, got)
        assert generation_tokens[name][0] - before[name] == num_kept, name
