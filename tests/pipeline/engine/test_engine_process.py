"""The engine core in its own process, reached through the rings (the real transport)."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest

from ringllm.ipc.instance import InstanceSegment
from ringllm.ipc.shm import cleanup_stale, list_segments
from ringllm.pipeline import LLM, Client, SamplingParams
from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.engine.ring_client import RingCoreClient
from ringllm.pipeline.errors import EngineDeadError
from ringllm.pipeline.frontend.async_llm import AsyncLLM

PROMPTS = [[5, 6, 7, 8], [9, 10] * 20, list(range(30, 100))]
PARAMS = SamplingParams(
    temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1
)


@pytest.fixture(scope="module")
def model_path(model_factory):
    return model_factory("llama")


def engine_args(model_path):
    return dict(model=str(model_path), dtype="float32", num_gpu_blocks_override=128)


@pytest.fixture(scope="module")
def reference(model_path):
    return LLM(**engine_args(model_path)).generate(PROMPTS, PARAMS, use_tqdm=False)


def assert_logprobs_close(ours, ref, tol=1e-5):
    """Same tokens, ranks and values; values to float32 rounding (BLAS may split sums
    differently in another process, so bit equality is not promised)."""
    assert len(ours) == len(ref)
    for mine, theirs in zip(ours, ref, strict=True):
        if theirs is None:
            assert mine is None
            continue
        assert mine.keys() == theirs.keys()
        for token, lp in theirs.items():
            assert mine[token].rank == lp.rank and mine[token].decoded_token == lp.decoded_token
            assert abs(mine[token].logprob - lp.logprob) <= tol


def segments_of(pid: int) -> list[str]:
    return [name for name in list_segments() if name.startswith(f"ringllm_{pid}_")]


def test_multiprocess_llm_equals_in_process(model_path, reference):
    with LLM(multiprocess=True, **engine_args(model_path)) as llm:
        engine_pid = llm.llm_engine.core_client.engine_pid
        got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        seeded = llm.generate(
            PROMPTS[:1], SamplingParams(n=3, seed=3, max_tokens=8), use_tqdm=False
        )
    for ours, ref in zip(got, reference, strict=True):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
        assert ours.outputs[0].text == ref.outputs[0].text
        assert_logprobs_close(ours.outputs[0].logprobs, ref.outputs[0].logprobs)
        assert_logprobs_close(ours.prompt_logprobs, ref.prompt_logprobs)
    in_process = LLM(**engine_args(model_path)).generate(
        PROMPTS[:1], SamplingParams(n=3, seed=3, max_tokens=8), use_tqdm=False
    )
    assert [c.token_ids for c in seeded[0].outputs] == [c.token_ids for c in in_process[0].outputs]
    assert not segments_of(engine_pid) and not segments_of(os.getpid())


def test_no_pickle_on_the_request_path(model_path, reference, monkeypatch):
    """After start-up, pickle is made to fail in both processes; a full run still works."""
    monkeypatch.setenv("RINGLLM_FORBID_PICKLE", "1")
    with LLM(multiprocess=True, **engine_args(model_path)) as llm:

        def refuse(*args, **kwargs):
            raise AssertionError("pickle used on the request path")

        for name in ("dumps", "loads", "dump", "load"):
            monkeypatch.setattr(pickle, name, refuse)
        got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        monkeypatch.undo()
        assert llm.llm_engine.core_client.process.poll() is None  # the engine did not die on it
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in reference]


@pytest.fixture
def engine(model_path):
    core = RingCoreClient.start(EngineConfig.from_kwargs(**engine_args(model_path)))
    yield core
    core.shutdown()


def test_several_clients_at_once(engine, reference):
    name = engine.instance_name
    before = set(segments_of(os.getpid()))
    with Client.connect(name) as first, Client.connect(name) as second:
        stream = list(first.generate(PROMPTS[0], PARAMS))
        assert stream[-1].outputs[0].token_ids == reference[0].outputs[0].token_ids

        async def both():
            async def one(client, prompt):
                outs = [o async for o in client.agenerate(prompt, PARAMS)]
                return outs[-1].outputs[0].token_ids

            return await asyncio.gather(
                one(first, PROMPTS[1]), one(second, PROMPTS[2]), one(second, PROMPTS[0])
            )

        got = asyncio.run(both())
    assert got == [
        reference[1].outputs[0].token_ids,
        reference[2].outputs[0].token_ids,
        reference[0].outputs[0].token_ids,
    ]
    assert set(segments_of(os.getpid())) == before  # each client's output ring went with it


def test_unknown_instance_name_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="no ringllm engine instance named"):
        Client.connect("ringllm_1_000000000000_engine")


CLIENT_SCRIPT = """
import sys
from ringllm.pipeline import Client
from ringllm.pipeline import SamplingParams
client = Client.connect(sys.argv[1])
for out in client.generate([5, 6, 7], SamplingParams(max_tokens=1500, ignore_eos=True)):
    print("token", flush=True)
"""


def test_dead_client_requests_are_aborted(engine):
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT_SCRIPT, engine.instance_name], stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout.readline().strip() == b"token"
        instance = InstanceSegment.attach(engine.instance_name)
        deadline = time.monotonic() + 5  # the load is published right after the step's outputs
        while instance.load()[0] != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert instance.load()[0] == 1  # its request is running
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 5
        while instance.load() != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert instance.load() == (0, 0), "the dead client's request still runs"
        instance.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    cleanup_stale()  # the killed client's output ring
    assert not segments_of(proc.pid)


def test_killed_engine_is_noticed_within_a_second(engine):
    async def run():
        llm = AsyncLLM(
            EngineConfig.from_kwargs(model=str(engine.info.model_path)),
            RingCoreClient.connect(engine.instance_name),
        )
        params = SamplingParams(max_tokens=1800, ignore_eos=True)
        agen = llm.generate([5, 6, 7], params)
        await agen.__anext__()
        os.kill(engine.engine_pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            async for _ in agen:
                pass
        noticed_s = time.monotonic() - start
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate([1, 2], params):
                pass
        assert not llm.is_healthy
        llm.shutdown()
        return noticed_s

    noticed_s = asyncio.run(run())
    assert noticed_s < 1.0
    engine.process.wait(5)
    # Nothing ran in the killed engine to unlink its segments; the client that saw it die
    # swept them at shutdown (what cleanup_stale() in the next instance would also do).
    assert not segments_of(engine.engine_pid)


def test_sigterm_stops_engine_cleanly(engine):
    pid = engine.engine_pid
    assert segments_of(pid)
    engine.process.send_signal(signal.SIGTERM)
    assert engine.process.wait(10) == 0
    assert not segments_of(pid)


def test_idle_engine_costs_under_2_percent_of_a_core(engine):
    def cpu_seconds(pid):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    time.sleep(0.5)
    before = cpu_seconds(engine.engine_pid)
    time.sleep(2.0)
    used = cpu_seconds(engine.engine_pid) - before
    assert used / 2.0 < 0.02, f"idle engine used {used:.3f} s of CPU in 2 s"


# The restart test's requests: long enough that the core, which runs ahead of this process,
# cannot finish them all between the step that shows every request's first tokens and the
# kill (12 tokens could: a loaded machine let the core finish first, and no restart was
# needed, 'num_restarts 0 == 1').
LONG_PARAMS = SamplingParams(
    temperature=0.0, max_tokens=160, ignore_eos=True, logprobs=2, prompt_logprobs=1
)


def test_multiprocess_llm_engine_restarts_a_killed_core_and_replays(model_path):
    """LLMEngine(multiprocess=True), as LLM(multiprocess=True) uses it: kill -9 its core
    once every request has tokens out; step() starts a new core, replays the unfinished
    sequences, and the outputs are those of an undisturbed run (logprobs included)."""
    from ringllm.pipeline.frontend.llm_engine import LLMEngine

    reference = LLM(**engine_args(model_path)).generate(PROMPTS, LONG_PARAMS, use_tqdm=False)
    engine = LLMEngine(EngineConfig.from_kwargs(**engine_args(model_path)), multiprocess=True)
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, LONG_PARAMS)
        final: dict[str, object] = {}
        killed = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final[out.request_id] = out
            # every request has tokens out and one at least is unfinished: the new core
            # has a sequence to replay (killed after the last one finished, no step would
            # notice, and the run would need no restart)
            unfinished = any(not out.finished for out in final.values())
            if killed is None and len(final) == len(PROMPTS) and unfinished:
                killed = engine.core_client.engine_pid
                os.kill(killed, signal.SIGKILL)
        assert killed is not None and engine.num_restarts == 1
        assert engine.core_client.engine_pid != killed
    finally:
        engine.shutdown()
    for i, ref in enumerate(reference):
        ours = final[f"r{i}"]
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
        assert_logprobs_close(ours.outputs[0].logprobs, ref.outputs[0].logprobs)
        assert_logprobs_close(ours.prompt_logprobs, ref.prompt_logprobs)
    assert not segments_of(killed)


def test_a_core_started_from_a_thread_outlives_that_thread(model_path, reference):
    """The kernel's parent-death signal follows the thread that forked a child: an engine
    made on a worker thread (or restarted by one) must not die when that thread returns.
    Children are forked by the spawner thread (child_process.start_child)."""
    import threading

    made: dict[str, LLM] = {}
    thread = threading.Thread(
        target=lambda: made.setdefault("llm", LLM(multiprocess=True, **engine_args(model_path)))
    )
    thread.start()
    thread.join()
    llm = made["llm"]
    try:
        time.sleep(0.5)  # a parent-death SIGTERM would have ended the core by now
        assert llm.llm_engine.core_client.process.poll() is None
        got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in reference]
        assert llm.llm_engine.num_restarts == 0
    finally:
        llm.shutdown()


def test_a_standby_core_becomes_a_working_core_or_leaves_cleanly(model_path, reference):
    """The warm spare: activated, it serves like a freshly started core (and says it was a
    standby: no interpreter start-up in its start); an unused one leaves at close()."""
    from ringllm.pipeline.engine.standby import StandbyCore

    unused = StandbyCore.spawn()
    unused.close()
    assert unused.process.poll() is not None and not unused.usable

    standby = StandbyCore.spawn()
    client = standby.activate(EngineConfig.from_kwargs(**engine_args(model_path)))
    with pytest.raises(RuntimeError, match="used or gone"):
        standby.activate(EngineConfig.from_kwargs(**engine_args(model_path)))
    llm = AsyncLLM(EngineConfig.from_kwargs(**engine_args(model_path)), client)
    try:
        assert client.startup_s["standby"] == 1 and client.startup_s["process_s"] == 0
        assert client.startup_s["model_s"] > 0 and client.startup_s["kv_cache_s"] > 0

        async def run():
            outs = []
            for prompt in PROMPTS:
                tokens = None
                async for out in llm.generate(prompt, PARAMS):
                    tokens = out.outputs[0].token_ids
                outs.append(tokens)
            return outs

        got = asyncio.run(run())
    finally:
        llm.shutdown()
    assert got == [r.outputs[0].token_ids for r in reference]
    assert not segments_of(client.engine_pid)
