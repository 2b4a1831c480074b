"""Tensor parallelism on the CPU (gloo): TP=2 gives TP=1's tokens and logits, through the
offline API in-process and behind the engine-core process; a dead rank is a clear error,
never a hang; nothing is left running or in /dev/shm. NCCL checks need a GPU."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from ringllm.ipc.shm import list_segments
from ringllm.pipeline import LLM, SamplingParams
from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.errors import EngineDeadError
from ringllm.pipeline.executor.process_groups import GlooCommunicator, Rendezvous
from ringllm.pipeline.executor.rank_process import threads_per_rank
from ringllm.pipeline.worker.model_runner import LOGITS_ALL, LOGITS_LAST, ModelRunner, RunnerRequest

PROMPTS = [[5, 6, 7, 8], list(range(30, 75)), [9, 10] * 12]
GREEDY = SamplingParams(
    temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=2
)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True, n=2)


@pytest.fixture(scope="module")
def even_model(model_factory):
    """Heads 4, kv heads 2, intermediate 128, vocab 512: all divide by 2; tied embeddings."""
    return model_factory("llama")


@pytest.fixture(scope="module")
def odd_vocab_model(model_factory):
    """Vocab 511 (the last shard is padded) and a separate lm_head matrix."""
    return model_factory("mistral", vocab_size=511)


def engine_args(path, **extra):
    return dict(model=str(path), dtype="float32", num_gpu_blocks_override=64, **extra)


def our_segments() -> set[str]:
    return {name for name in list_segments() if name.startswith(f"ringllm_{os.getpid()}_")}


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"worker pid {pid} is still there"


def assert_same_outputs(got, ref, atol=1e-4):
    for ours, theirs in zip(got, ref, strict=True):
        for a, b in zip(ours.outputs, theirs.outputs, strict=True):
            assert a.token_ids == b.token_ids
            for lp_a, lp_b in zip(a.logprobs or [], b.logprobs or [], strict=True):
                assert lp_a.keys() == lp_b.keys()
                for token in lp_a:
                    assert lp_a[token].logprob == pytest.approx(lp_b[token].logprob, abs=atol)
        for pa, pb in zip(ours.prompt_logprobs or [], theirs.prompt_logprobs or [], strict=True):
            assert (pa is None) == (pb is None)
            if pa is not None:
                assert {t: p.logprob for t, p in pa.items()} == pytest.approx(
                    {t: p.logprob for t, p in pb.items()}, abs=atol
                )


def test_tp2_in_process_equals_tp1(even_model):
    args = engine_args(even_model)
    ref = LLM(**args).generate(PROMPTS, GREEDY, use_tqdm=False)
    ref_seeded = LLM(**args).generate(PROMPTS[:1], SEEDED, use_tqdm=False)
    segments_before = our_segments()
    with LLM(tensor_parallel_size=2, **args) as llm:
        executor = llm.llm_engine.engine_core.executor
        pids, store = executor.pids, executor._ranks.rendezvous.address
        assert len(pids) == 2 and len(our_segments() - segments_before) == 2
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        got_seeded = llm.generate(PROMPTS[:1], SEEDED, use_tqdm=False)
    assert_same_outputs(got, ref)
    assert_same_outputs(got_seeded, ref_seeded)
    assert_gone(pids)
    assert our_segments() == segments_before
    assert not os.path.exists(os.path.dirname(store))


def test_tp2_speculative_ngram_equals_tp1_without_it(even_model):
    """Drafts ride in the STEP record, accepted runs and proposals in rank 0's OUTPUT:
    greedy tokens and logprobs are those of one rank without speculation, and a seeded
    request gives the same tokens on two ranks as on one with speculation (every rank
    verifies with the same random draws)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    args = engine_args(even_model)
    prompts = [*PROMPTS, [11, 12, 13] * 8]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    ref = LLM(**args).generate(prompts, greedy, use_tqdm=False)
    ref_seeded = LLM(speculative_config=spec, **args).generate(prompts, SEEDED, use_tqdm=False)
    with LLM(tensor_parallel_size=2, multiprocess=True, speculative_config=spec, **args) as llm:
        got = llm.generate(prompts, greedy, use_tqdm=False)
        got_seeded = llm.generate(prompts, SEEDED, use_tqdm=False)
        assert llm.llm_engine.front_end.spec_decoding.num_accepted_tokens > 0
    assert_same_outputs(got, ref)
    assert_same_outputs(got_seeded, ref_seeded)


def test_tp2_multiprocess_with_padded_vocab_equals_tp1(odd_vocab_model, monkeypatch):
    args = engine_args(odd_vocab_model)
    ref = LLM(**args).generate(PROMPTS, GREEDY, use_tqdm=False)
    # After start-up the engine core and both ranks make pickle fail: the run must not need it.
    monkeypatch.setenv("RINGLLM_FORBID_PICKLE", "1")
    with LLM(tensor_parallel_size=2, multiprocess=True, **args) as llm:
        engine_pid = llm.llm_engine.core_client.engine_pid
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert llm.llm_engine.core_client.process.poll() is None  # no rank or core died of it
    assert_same_outputs(got, ref)
    assert not os.path.exists(f"/proc/{engine_pid}")
    assert not [name for name in list_segments() if name.startswith(f"ringllm_{engine_pid}_")]


def run_ranks(config: EngineConfig, steps) -> list[list[torch.Tensor]]:
    """Two ModelRunners, ranks 0 and 1 of a gloo group, each in a thread of this process."""
    rendezvous = Rendezvous.create("cpu")
    results: list = [None, None]

    def rank_main(rank: int) -> None:
        comm = GlooCommunicator(rank, 2, rendezvous.address)
        try:
            runner = ModelRunner(config, comm=comm)
            runner.initialize_kv_cache(32)
            model = runner.model
            shapes = (model.embed.shape, model.lm_head.shape, model.layers[0].gate_up.shape)
            results[rank] = ([runner.execute(step).logits for step in steps], shapes)
        finally:
            comm.close()

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    rendezvous.close()
    assert results[0] is not None and results[1] is not None, "a rank failed (see its traceback)"
    return results


@pytest.mark.parametrize("model", ["even_model", "odd_vocab_model"])
def test_tp2_float32_logits_within_1e4_of_tp1(model, request):
    path = request.getfixturevalue(model)
    steps = [
        [RunnerRequest(list(range(3, 40)), 0, [0, 1, 2], LOGITS_ALL)],  # prefill, every row
        [  # a decode of the first request next to a second prompt
            RunnerRequest([41], 37, [0, 1, 2], LOGITS_LAST),
            RunnerRequest([7, 8, 9, 10, 11], 0, [3], LOGITS_ALL),
        ],
    ]
    tp1 = ModelRunner(EngineConfig.from_kwargs(**engine_args(path)))
    tp1.initialize_kv_cache(32)
    expected = [tp1.execute(step).logits for step in steps]
    tp2_config = EngineConfig.from_kwargs(**engine_args(path, tensor_parallel_size=2))
    (rank0, shapes0), (rank1, shapes1) = run_ranks(tp2_config, steps)
    arch = tp1.arch
    shard_rows = -(-arch.vocab_size // 2)  # 256 of 512, or 256 of 511 (one padded row)
    for shapes in (shapes0, shapes1):  # each rank holds only its shards
        assert shapes[0] == shapes[1] == (shard_rows, arch.hidden_size)
        assert shapes[2] == (arch.intermediate_size, arch.hidden_size)  # gate|up: 2 halves
    for want, got0, got1 in zip(expected, rank0, rank1, strict=True):
        assert got0.shape == want.shape == (want.shape[0], arch.vocab_size)
        assert torch.equal(got0, got1)  # the ranks agree bit for bit: they sample alike
        torch.testing.assert_close(got0, want, atol=1e-4, rtol=0)


def test_ranks_share_the_cpu_threads():
    share = max(1, (os.cpu_count() or 1) // 2)
    assert threads_per_rank(2, None) == share
    assert threads_per_rank(2, 1) == 1
    assert threads_per_rank(2, 10**6) == share
    assert threads_per_rank(10**6, None) == 1


def generate_error_or_hang(llm, after: str) -> BaseException | None:
    """What `llm.generate` raises (None if nothing), failing the test if it runs 60 s."""
    outcome: dict = {}

    def generate() -> None:
        try:
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        except BaseException as exc:
            outcome["error"] = exc

    watcher = threading.Thread(target=generate, daemon=True)
    watcher.start()
    watcher.join(timeout=60)
    assert not watcher.is_alive(), f"generate() hung after {after}"
    return outcome.get("error")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_killed_rank_is_a_clear_error_not_a_hang(even_model, rank):
    segments_before = our_segments()
    llm = LLM(tensor_parallel_size=2, **engine_args(even_model))
    executor = llm.llm_engine.engine_core.executor
    pids = executor.pids
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)  # warm: the ranks are serving
    os.kill(pids[rank], signal.SIGKILL)
    error = generate_error_or_hang(llm, "a rank was killed")
    assert isinstance(error, EngineDeadError), f"expected EngineDeadError, got {error!r}"
    assert f"rank {rank} (pid {pids[rank]}) died (killed by SIGKILL)" in str(error)
    with pytest.raises(EngineDeadError, match="cannot continue"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    llm.shutdown()
    assert_gone(pids)
    assert our_segments() == segments_before


def rank_pids_of(engine_pid: int) -> list[int]:
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat_file:
                ppid = int(stat_file.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline_file:
                is_rank = b"ringllm.pipeline.executor.rank_process" in cmdline_file.read()
        except OSError:
            continue
        if ppid == engine_pid and is_rank:
            pids.append(int(entry))
    return pids


@pytest.mark.slow  # over HTTP by default: test_engine_restart.py's tensor-parallel kill -9
def test_a_killed_rank_behind_the_engine_process_restarts_the_whole_group(even_model):
    """The engine core exits when a rank dies; the supervisor starts a new core with new
    ranks and replays: generate() returns what an undisturbed run gives."""
    llm = LLM(tensor_parallel_size=2, multiprocess=True, **engine_args(even_model))
    try:
        engine_pid = llm.llm_engine.core_client.engine_pid
        ranks = rank_pids_of(engine_pid)
        os.kill(ranks[1], signal.SIGKILL)
        outcome: dict = {}

        def generate() -> None:
            outcome["outputs"] = llm.generate(PROMPTS, GREEDY, use_tqdm=False)

        watcher = threading.Thread(target=generate, daemon=True)
        watcher.start()
        watcher.join(timeout=120)
        assert not watcher.is_alive(), "generate() hung after a rank was killed"
        assert llm.llm_engine.num_restarts == 1
        new_engine = llm.llm_engine.core_client.engine_pid
        assert new_engine != engine_pid and len(rank_pids_of(new_engine)) == 2
        undisturbed = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outcome["outputs"]]
        assert got == [o.outputs[0].token_ids for o in undisturbed]
    finally:
        llm.shutdown()
    assert_gone([engine_pid, *ranks, new_engine])
    assert not [n for n in list_segments() if n.startswith(f"ringllm_{engine_pid}_")]


def test_a_killed_rank_behind_the_engine_process_ends_it_cleanly(even_model):
    llm = LLM(tensor_parallel_size=2, multiprocess=True, max_restarts=0, **engine_args(even_model))
    engine_pid = llm.llm_engine.core_client.engine_pid
    ranks = rank_pids_of(engine_pid)
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGKILL)
    error = generate_error_or_hang(llm, "a rank behind the engine was killed")
    assert isinstance(error, EngineDeadError), f"expected EngineDeadError, got {error!r}"
    llm.shutdown()
    assert_gone([engine_pid, *ranks])
    assert not [name for name in list_segments() if name.startswith(f"ringllm_{engine_pid}_")]


def test_a_shape_that_does_not_split_is_refused_by_name(even_model):
    segments_before = our_segments()
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 3 ranks do not divide"):
        LLM(tensor_parallel_size=3, **engine_args(even_model))
    assert our_segments() == segments_before


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="two CUDA devices are visible here")
def test_more_gpu_ranks_than_devices_is_refused_by_name(even_model):
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 2 ranks need 2 CUDA devices"):
        LLM(tensor_parallel_size=2, device="cuda", **engine_args(even_model))


def test_gloo_collectives_between_two_ranks():
    rendezvous = Rendezvous.create("cpu")
    results: list = [None, None]

    def rank_main(rank: int) -> None:
        comm = GlooCommunicator(rank, 2, rendezvous.address)
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1)
        summed = comm.all_reduce(x.clone())
        rows = comm.all_gather(x, dim=0)
        cols = comm.all_gather(x, dim=1)
        empty = comm.all_gather(torch.zeros(0, 3), dim=0)
        sent = comm.broadcast(torch.full((4,), float(rank)), src=1)
        comm.barrier()
        comm.close()
        results[rank] = (summed, rows, cols, empty, sent)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    rendezvous.close()
    x0 = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    for summed, rows, cols, empty, sent in results:
        assert torch.equal(summed, 3 * x0)
        assert torch.equal(rows, torch.cat([x0, 2 * x0], dim=0))
        assert torch.equal(cols, torch.cat([x0, 2 * x0], dim=1))
        assert empty.shape == (0, 3)
        assert torch.equal(sent, torch.ones(4))
    assert not os.path.exists(os.path.dirname(rendezvous.address))
    with pytest.raises(ValueError, match=r"rank: must be in \[0, 2\) for world_size 2, got 2"):
        GlooCommunicator(2, 2, rendezvous.address)


# ---- NCCL (GPU) -----------------------------------------------------------------------


def _cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_devices() < 1, reason="needs a CUDA device")
def test_nccl_single_rank_collectives_on_torch_stream():
    from ringllm.cuda.nccl_comm import NcclCommunicator

    rendezvous = Rendezvous.create("cuda")
    comm = NcclCommunicator.connect(0, 1, rendezvous.address)
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.randn(5, 7, device="cuda").to(dtype)
            assert torch.equal(comm.all_reduce(x.clone()), x)
            assert torch.equal(comm.all_gather(x, dim=1), x)
            assert torch.equal(comm.broadcast(x.clone(), src=0), x)
        comm.barrier()
    finally:
        comm.close()
        rendezvous.close()


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_devices() < 2, reason="needs a CUDA device (two of them)")
def test_nccl_tp2_equals_tp1(even_model):
    args = dict(model=str(even_model), dtype="float32", num_gpu_blocks_override=64, device="cuda")
    ref = LLM(**args).generate(PROMPTS, GREEDY, use_tqdm=False)
    with LLM(tensor_parallel_size=2, **args) as llm:
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_same_outputs(got, ref)


def test_nccl_unique_id_rendezvous_layout_without_a_gpu():
    from ringllm.cuda import nccl_comm
    from ringllm.ipc import _atomics
    from ringllm.ipc.shm import Segment

    segment = nccl_comm.create_unique_id_segment()
    peer = Segment.attach(segment.name)
    try:
        with pytest.raises(TimeoutError, match="did not publish the NCCL unique id"):
            nccl_comm.wait_unique_id(peer, timeout_s=0.01)
        raw = bytes(range(128))  # what rank 0 writes: the id, then the flag
        segment.buf[8:136] = raw
        _atomics.store_u64(segment.buf, 0, 1)
        assert nccl_comm.wait_unique_id(peer, timeout_s=1.0) == raw
    finally:
        peer.close()
        segment.close()
    assert segment.name not in list_segments()


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("cupy") is not None, reason="CuPy is installed"
)
def test_nccl_without_cupy_says_what_to_install():
    from ringllm.cuda.nccl_comm import NcclCommunicator

    with pytest.raises(RuntimeError, match=r"needs CuPy with NCCL: pip install 'ringllm\[gpu\]'"):
        NcclCommunicator.connect(0, 1, "unused")


def test_tp2_ranks_sleep_and_wake_to_the_same_outputs(even_model):
    """Every rank frees its KV cache and offloads (1) or drops (2) its weight shards; each
    wakes to the outputs it gave before (the group stays the same processes)."""
    with LLM(tensor_parallel_size=2, enable_sleep_mode=True, **engine_args(even_model)) as llm:
        pids = llm.llm_engine.engine_core.executor.pids
        ref = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        for level in (1, 2):
            llm.sleep(level)
            llm.wake_up()
            assert_same_outputs(llm.generate(PROMPTS, GREEDY, use_tqdm=False), ref, atol=0)
        llm.sleep(2)
        llm.wake_up(["weights"])  # each rank reloads its shards; the KV caches after
        llm.wake_up(["kv_cache"])
        assert_same_outputs(llm.generate(PROMPTS, GREEDY, use_tqdm=False), ref, atol=0)
        assert llm.llm_engine.engine_core.executor.pids == pids
    assert_gone(pids)
