"""The draft-model proposer against the target model itself as the oracle: a draft that is
the target drafts exactly the target's greedy continuation (after catch-ups of any length,
decodes and prefills mixed in one pass, and a restart from position 0), and its q rows are
the target's filtered distributions. Plus its refusals, and `make-model --draft-of`."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.core.scheduler_output import NewRequestData
from ringllm.pipeline.sample.sampler import Sampler
from ringllm.pipeline.sampling_params import SamplingParams
from ringllm.pipeline.worker.draft_proposer import DraftModelProposer
from ringllm.pipeline.worker.input_batch import InputBatch
from ringllm.pipeline.worker.model_runner import LOGITS_ALL, ModelRunner, RunnerRequest
from ringllm.tools.cli import main as ringllm_main
from ringllm.tools.make_model import make_draft

K = 4
BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
NUM_BLOCKS = 256
BLOCKS_PER_REQUEST = MAX_MODEL_LEN // BLOCK_SIZE


def engine_config(target, draft, device="cpu", **kwargs) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model=str(target),
        dtype="float32",
        device=device,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=NUM_BLOCKS,
        speculative_config={"model": str(draft), "num_speculative_tokens": K},
        **kwargs,
    )


@pytest.fixture(scope="module")
def target(model_factory):
    return model_factory("llama")


@pytest.fixture(scope="module")
def runner(target):
    runner = ModelRunner(engine_config(target, target))
    runner.initialize_kv_cache(NUM_BLOCKS)
    return runner


@pytest.fixture
def proposer(target, runner):
    """The target itself as its draft: every greedy draft must be the target's own token."""
    proposer = DraftModelProposer(engine_config(target, target), runner)
    proposer.initialize_kv_cache(NUM_BLOCKS)
    return proposer


def blocks_of(i: int) -> list[int]:
    """Request i's blocks, enough for MAX_MODEL_LEN, in reverse order (a table, not a range)."""
    return list(range((i + 1) * BLOCKS_PER_REQUEST - 1, i * BLOCKS_PER_REQUEST - 1, -1))


def greedy_continuation(runner, prompt: list[int], num_tokens: int) -> list[int]:
    """The target's greedy tokens after `prompt`, one step at a time (prefill, then decodes)
    through ModelRunner.execute, in blocks no draft test uses."""
    blocks = list(range(NUM_BLOCKS - BLOCKS_PER_REQUEST, NUM_BLOCKS))
    tokens, computed, out = list(prompt), 0, []
    while len(out) < num_tokens and len(tokens) < MAX_MODEL_LEN:
        step = runner.execute([RunnerRequest(tokens[computed:], computed, blocks)])
        computed = len(tokens)
        token = int(step.logits[-1].argmax())
        tokens.append(token)
        out.append(token)
    return out


def target_logits(runner, tokens: list[int], num_rows: int) -> torch.Tensor:
    """The target's logits at the last `num_rows` positions of `tokens` (one prefill): row j
    is its next-token distribution after tokens[: len(tokens) - num_rows + 1 + j]."""
    blocks = list(range(NUM_BLOCKS - BLOCKS_PER_REQUEST, NUM_BLOCKS))
    step = runner.execute([RunnerRequest(tokens, 0, blocks, logits=LOGITS_ALL)])
    return step.logits[len(tokens) - num_rows :]


def add_row(batch: InputBatch, rid: str, i: int, tokens: list[int], blocks=None, **params):
    """A row as the worker has it when it proposes: the prompt + the token just sampled."""
    batch.add(
        NewRequestData(
            rid, list(tokens), len(tokens) - 1, SamplingParams(**params), (0,),
            blocks_of(i) if blocks is None else blocks, len(tokens) - 1,
        )
    )  # fmt: skip


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = [1, 2, 7, 13, 5, 21][:n]
    return [rng.integers(3, 500, length).tolist() for length in lengths]


def propose(proposer, batch, rids):
    rows = np.array([batch.row_of[r] for r in rids])
    return proposer.propose(batch, rows, list(rids))


def check_against_the_target(runner, batch, rids, out, atol=1e-5) -> None:
    """Greedy rows: the drafts are the target's greedy continuation. Others: each q_j is the
    target's filtered distribution after the row's tokens and the drafts before d_j (a
    check that sees every token of the context, where the tiny model's greedy runs repeat)."""
    for rid, drafts, q in zip(rids, out.token_ids, out.probs, strict=True):
        row = batch.row_of[rid]
        known = batch.token_ids[row, : batch.num_tokens[row]].tolist()
        params = batch.sampling[row].params
        assert drafts.dtype == np.int32 and len(drafts) == min(K, MAX_MODEL_LEN - len(known))
        if len(drafts) == 0:
            continue
        # the target after known + d_0 .. d_(j-1), for every j at once
        logits = target_logits(runner, known + drafts[:-1].tolist(), len(drafts))
        if params.is_greedy:
            assert q is None
            assert drafts.tolist() == logits.argmax(-1).tolist(), rid
            continue
        assert tuple(q.shape) == (len(drafts), runner.arch.vocab_size)
        oracle = Sampler(runner.arch.vocab_size).filtered_probs(logits, [params] * len(drafts))
        torch.testing.assert_close(q, oracle, atol=atol, rtol=1e-4, msg=rid)


def move_on(runner, batch, rid, drafts, num_accepted, refused=False, num_plain=0) -> None:
    """The row as the verifier leaves it: its first `num_accepted` drafts, then one token,
    the target's own (the bonus) or another one (drawn at a refusal: the drafts' KV past it
    is stale); then `num_plain` steps without drafts (speculation off for a while)."""
    row = batch.row_of[rid]
    known = batch.token_ids[row, : batch.num_tokens[row]].tolist()
    new = drafts[:num_accepted].tolist()
    (token,) = greedy_continuation(runner, known + new, 1)
    new.append((token + 1) % runner.arch.vocab_size if refused else token)
    new += greedy_continuation(runner, known + new, num_plain) if num_plain else []
    for token in new:
        batch.append_tokens(np.array([row]), np.array([token], np.int32))


def test_drafts_follow_the_target_across_calls(runner, proposer):
    batch = InputBatch(BLOCK_SIZE, MAX_MODEL_LEN)
    rids = [f"r{i}" for i in range(6)]
    for i, (rid, prompt) in enumerate(zip(rids, prompts(6), strict=True)):
        params = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=1.0, seed=i)
        add_row(batch, rid, i, prompt + greedy_continuation(runner, prompt, 1), **params)
        proposer.start(rid)
    order = ["r3", "r0", "r5", "r1", "r4", "r2"]  # not the rows' order
    out = propose(proposer, batch, order)
    check_against_the_target(runner, batch, order, out)
    # The next catch-up is 1 token (a decode) for some rows, several for others.
    drafts = dict(zip(order, out.token_ids, strict=True))
    move_on(runner, batch, "r0", drafts["r0"], 0, refused=True)
    move_on(runner, batch, "r1", drafts["r1"], K)
    move_on(runner, batch, "r2", drafts["r2"], 1, refused=True)
    move_on(runner, batch, "r3", drafts["r3"], 0, refused=True, num_plain=2)
    move_on(runner, batch, "r4", drafts["r4"], 2)
    move_on(runner, batch, "r5", drafts["r5"], K - 1, refused=True)
    proposer.start("r4")  # resumed: recomputed from position 0 in the same pass
    proposer.finish("r5")  # gone (and unknown again: recomputed too, if asked)
    check_against_the_target(runner, batch, rids, propose(proposer, batch, rids))
    # no new token since: the last one is fed again
    check_against_the_target(runner, batch, ["r2"], propose(proposer, batch, ["r2"]))
    # KV lost (as after a preemption): start() makes every row recompute from position 0
    for key_cache, value_cache in proposer.kv_caches:
        key_cache.normal_()
        value_cache.normal_()
    for rid in rids:
        proposer.start(rid)
    check_against_the_target(runner, batch, rids, propose(proposer, batch, rids))


def test_greedy_drafts_of_rows_of_every_length(runner, proposer):
    batch = InputBatch(BLOCK_SIZE, MAX_MODEL_LEN)
    rids = [f"r{i}" for i in range(6)]
    for i, (rid, prompt) in enumerate(zip(rids, prompts(6, seed=3), strict=True)):
        add_row(batch, rid, i, prompt + [11], temperature=0.0)
    out = propose(proposer, batch, rids)
    check_against_the_target(runner, batch, rids, out)
    for drafts, prompt in zip(out.token_ids, prompts(6, seed=3), strict=True):
        assert drafts.tolist() == greedy_continuation(runner, prompt + [11], K)


def test_exactly_k_forward_passes_for_all_rows(runner, proposer, monkeypatch):
    batch = InputBatch(BLOCK_SIZE, MAX_MODEL_LEN)
    rids = [f"r{i}" for i in range(4)]
    for i, prompt in enumerate(prompts(4)):
        add_row(batch, rids[i], i, prompt + [7], temperature=0.0 if i % 2 else 0.9)
    calls = []
    forward = proposer.model.forward

    def counted(fb, kv_caches):
        calls.append((fb.num_tokens, fb.num_decodes))
        return forward(fb, kv_caches)

    monkeypatch.setattr(proposer.model, "forward", counted)
    out = propose(proposer, batch, rids)
    assert calls == [(sum(len(p) + 1 for p in prompts(4)), 0)] + [(4, 4)] * (K - 1)
    # then one row gets its bonus token only, the others 3 tokens: a decode and 3 prefills
    for rid, drafts in zip(rids, out.token_ids, strict=True):
        move_on(runner, batch, rid, drafts, 0 if rid == "r2" else 2)
    calls.clear()
    check_against_the_target(runner, batch, rids, propose(proposer, batch, rids))
    assert calls == [(1 + 3 * 3, 1)] + [(4, 4)] * (K - 1)


def test_drafts_stop_short_of_max_model_len(runner, proposer):
    batch = InputBatch(BLOCK_SIZE, MAX_MODEL_LEN)
    prompt = prompts(1)[0]
    tokens = prompt + greedy_continuation(runner, prompt, MAX_MODEL_LEN)
    lengths = {"full": MAX_MODEL_LEN, "two": MAX_MODEL_LEN - 2, "all": MAX_MODEL_LEN - K}
    for i, (rid, n) in enumerate(lengths.items()):
        add_row(batch, rid, i, tokens[:n], temperature=0.0 if rid != "two" else 0.8)
    out = propose(proposer, batch, list(lengths))
    assert [len(d) for d in out.token_ids] == [0, 2, K]
    assert out.token_ids[2].tolist() == tokens[MAX_MODEL_LEN - K :]
    assert out.probs[0] is None and tuple(out.probs[1].shape) == (2, runner.arch.vocab_size)


def test_random_drafts_are_drawn_from_the_targets_filtered_distribution(runner, proposer):
    params = [
        dict(temperature=0.8, top_p=0.9, seed=7),
        dict(temperature=1.3, top_k=20),
        dict(temperature=0.0),
        dict(temperature=0.7, min_p=0.05, seed=11),
    ]
    batch = InputBatch(BLOCK_SIZE, MAX_MODEL_LEN)
    rids = [f"r{i}" for i in range(len(params))]
    known = {}
    for i, (rid, prompt, p) in enumerate(zip(rids, prompts(4, seed=1), params, strict=True)):
        known[rid] = prompt + [5]
        add_row(batch, rid, i, known[rid], **p)
    out = propose(proposer, batch, rids)
    check_against_the_target(runner, batch, rids, out)
    for drafts, q in zip(out.token_ids, out.probs, strict=True):
        if q is not None:
            assert q.dtype == torch.float32
            torch.testing.assert_close(q.sum(-1), torch.ones(K), atol=1e-5, rtol=0)
            assert (q[torch.arange(K), torch.from_numpy(drafts).long()] > 0).all()


def test_random_drafts_have_the_distribution_of_q(runner, proposer):
    """Many copies of one row in one call: the first drafts' frequencies are q_0's."""
    num_rows, blocks_per_row = 1024, 3
    proposer.initialize_kv_cache(num_rows * blocks_per_row)
    batch = InputBatch(BLOCK_SIZE, MAX_MODEL_LEN)
    prompt = prompts(3, seed=2)[2][:7] + [5]  # 8 tokens + K - 1 drafts: 3 blocks
    for i in range(num_rows):
        blocks = list(range(i * blocks_per_row, (i + 1) * blocks_per_row))
        add_row(batch, f"r{i}", i, prompt, blocks, temperature=8.0, top_k=4)
    out = propose(proposer, batch, [f"r{i}" for i in range(num_rows)])
    q0 = out.probs[0][0]
    torch.testing.assert_close(torch.stack([q[0] for q in out.probs]), q0.expand(num_rows, -1))
    counts = np.bincount([d[0] for d in out.token_ids], minlength=q0.numel()) / num_rows
    assert int((q0 > 0).sum()) == 4 and float(q0.max()) < 0.8
    assert 0.5 * np.abs(counts - q0.numpy()).sum() < 0.06  # total variation; ~0.02 expected


def test_a_seeded_row_drafts_the_same_from_a_fresh_generator(runner, proposer):
    prompt = prompts(3)[2] + [9]

    def drafts_of_a_fresh_request():
        batch = InputBatch(BLOCK_SIZE, MAX_MODEL_LEN)
        add_row(batch, "s", 0, prompt, temperature=1.5, seed=123)
        add_row(batch, "u", 1, prompt, temperature=1.5)  # unseeded: the shared generator
        proposer.start("s")
        proposer.start("u")
        out = propose(proposer, batch, ["u", "s"])
        return out.token_ids[1].tolist(), out.probs[1]

    (first, q1), (second, q2) = drafts_of_a_fresh_request(), drafts_of_a_fresh_request()
    assert first == second
    torch.testing.assert_close(q1, q2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_drafts_follow_the_target_on_a_gpu(target):
    pytest.importorskip("cupy", reason="needs CuPy (the gpu extra) to launch kernels")
    config = engine_config(target, target, device="cuda")
    runner = ModelRunner(config)
    runner.initialize_kv_cache(NUM_BLOCKS)
    proposer = DraftModelProposer(config, runner)
    proposer.initialize_kv_cache(NUM_BLOCKS)
    batch = InputBatch(BLOCK_SIZE, MAX_MODEL_LEN, device="cuda")  # seeded generators there
    rids = [f"r{i}" for i in range(4)]
    for i, prompt in enumerate(prompts(4)):
        params = [dict(temperature=0.0), dict(temperature=0.9, seed=5), dict(top_p=0.8)][i % 3]
        add_row(batch, rids[i], i, prompt + [3], **params)
    out = propose(proposer, batch, rids)
    check_against_the_target(runner, batch, rids, out, atol=1e-4)
    for rid, drafts, num_accepted in zip(rids, out.token_ids, [0, 1, K, 2], strict=True):
        move_on(runner, batch, rid, drafts, num_accepted, refused=num_accepted == 1)
    check_against_the_target(runner, batch, rids, propose(proposer, batch, rids), atol=1e-4)


def test_a_draft_with_another_vocabulary_or_tokenizer_is_refused(model_factory, target, runner):
    bigger_vocab = model_factory("llama", model_vocab_size=600)  # same tokenizer, 600 rows
    with pytest.raises(ValueError, match=r"speculative_config.model: .*vocab_size is 600"):
        DraftModelProposer(engine_config(target, bigger_vocab), runner)
    other_tokenizer = model_factory("llama", vocab_size=500, model_vocab_size=512)
    with pytest.raises(ValueError, match=r"speculative_config.model: .*tokenizer.json differs"):
        DraftModelProposer(engine_config(target, other_tokenizer), runner)


def test_a_draft_that_does_not_load_or_is_too_short_is_refused(
    model_factory, target, runner, tmp_path
):
    with pytest.raises(ValueError, match=r"speculative_config.model: .* does not load.*exist"):
        DraftModelProposer(engine_config(target, tmp_path / "nope"), runner)
    no_weights = tmp_path / "no_weights"
    shutil.copytree(target, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"speculative_config.model: .* does not load.*weights"):
        DraftModelProposer(engine_config(target, no_weights), runner)
    short = model_factory("llama", max_position_embeddings=32)
    with pytest.raises(ValueError, match=r"speculative_config.model: .*max_model_len of 64"):
        DraftModelProposer(engine_config(target, short), runner)


def test_a_truncated_draft_loads_and_drafts(model_factory, tmp_path):
    target = model_factory("llama", num_layers=3)
    assert ringllm_main(["make-model", str(tmp_path / "d"), "--draft-of", str(target),
                         "--num-layers", "1"]) == 0  # fmt: skip
    draft = tmp_path / "d"
    config = json.loads((draft / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    assert (draft / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert not any(n.startswith(("model.layers.1.", "model.layers.2.")) for n in names)
    runner = ModelRunner(engine_config(target, draft))
    proposer = DraftModelProposer(engine_config(target, draft), runner)
    proposer.initialize_kv_cache(NUM_BLOCKS)
    assert proposer.arch.num_hidden_layers == 1
    assert proposer.kv_bytes_per_block * 3 == runner.kv_bytes_per_block
    batch = InputBatch(BLOCK_SIZE, MAX_MODEL_LEN)
    add_row(batch, "r", 0, prompts(3)[2], temperature=0.0)
    assert len(propose(proposer, batch, ["r"]).token_ids[0]) == K
    with pytest.raises(ValueError, match=r"num_layers: must be in \[1, 3\]"):
        make_draft(tmp_path / "e", target, 4)
