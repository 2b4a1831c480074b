"""What one bad request or one bad front end costs a real engine process: that request or
that front end, never the engine or the others.

Failures are real exceptions raised in the engine process at a named point
(`RINGLLM_TEST_FAULTS`, pipeline/errors.py) for the request whose seed a test picks; the
front ends are real processes and real rings (one that stops reading is SIGSTOPped).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ringllm.ipc.instance import InstanceSegment
from ringllm.ipc.mpsc import MpscRing
from ringllm.ipc.shm import cleanup_stale
from ringllm.pipeline import LLM, Client, SamplingParams
from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.engine import records
from ringllm.pipeline.engine.ring_client import RingCoreClient
from ringllm.pipeline.errors import RequestFailedError
from tests.conftest import environment

FORWARD_SEED, SAMPLE_SEED, ADD_SEED = 6661, 6662, 6663
FAULTS = f"forward={FORWARD_SEED},sample={SAMPLE_SEED},add={ADD_SEED}"
PROMPTS = [[5, 6, 7, 8], [9, 10] * 20, list(range(30, 100))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=1)


def engine_args(model_path):
    return dict(model=str(model_path), dtype="float32", num_gpu_blocks_override=8192)


@pytest.fixture(scope="module")
def model_path(model_factory):
    return model_factory("llama")


@pytest.fixture(scope="module")
def reference(model_path):
    outs = LLM(**engine_args(model_path)).generate(PROMPTS, GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, len(o.prompt_logprobs)) for o in outs]


@pytest.fixture(scope="module")
def engine(model_path):
    """An engine process with every fault point armed (for its marked seeds only), whose
    output backlog gives up on a front end after 1 s."""
    with environment(RINGLLM_TEST_FAULTS=FAULTS, RINGLLM_OUTPUT_BACKLOG_TIMEOUT_S="1"):
        core = RingCoreClient.start(EngineConfig.from_kwargs(**engine_args(model_path)))
    yield core
    core.shutdown()


def wait_for_load(instance: InstanceSegment, wanted, timeout_s: float = 10.0) -> tuple:
    deadline = time.monotonic() + timeout_s
    while (load := instance.load()) != wanted and time.monotonic() < deadline:
        time.sleep(0.02)
    return load


async def _run(client: Client, prompt, params):
    """(token ids, prompt logprob rows) of a request, or the exception it ended with."""
    try:
        outs = [o async for o in client.agenerate(prompt, params)]
    except Exception as exc:  # noqa: BLE001 - the test looks at which
        return exc
    return outs[-1].outputs[0].token_ids, len(outs[-1].prompt_logprobs or [])


def run_together(client: Client, jobs) -> list:
    async def all_of():
        return await asyncio.gather(*(_run(client, p, sp) for p, sp in jobs))

    return asyncio.run(all_of())


@pytest.mark.parametrize(
    "seed", [FORWARD_SEED, SAMPLE_SEED, ADD_SEED], ids=["forward", "sample", "add"]
)
def test_a_request_that_fails_in_the_engine_fails_alone(engine, reference, seed):
    bad = SamplingParams(temperature=0.8, seed=seed, max_tokens=24, ignore_eos=True)
    with Client.connect(engine.instance_name) as client:
        jobs = [(PROMPTS[0], GREEDY), (PROMPTS[1], bad), (PROMPTS[1], GREEDY), (PROMPTS[2], GREEDY)]
        got = run_together(client, jobs)
        failed = got[1]
        assert isinstance(failed, RequestFailedError), failed
        assert "the engine failed while computing this request" in str(failed)
        assert "Injected" not in str(failed)  # the cause stays in the engine's log
        # the others: exactly what an engine without faults gives (tokens and prompt
        # logprobs, none repeated although they were recomputed after the failed step)
        assert got[0] == reference[0] and got[2] == reference[1] and got[3] == reference[2]
        # and the engine goes on
        assert run_together(client, [(PROMPTS[2], GREEDY)]) == [reference[2]]
    instance = InstanceSegment.attach(engine.instance_name)
    assert wait_for_load(instance, (0, 0)) == (0, 0)
    instance.close()
    assert engine.process.poll() is None


def test_a_hello_naming_no_ring_costs_only_that_producer(engine, reference):
    ring = MpscRing.attach(
        InstanceSegment.attach(engine.instance_name).info()["request_ring"],
        records.REQUEST,
        blob_bytes_field="blob_bytes",
    )
    producer = ring.producer()
    producer.write(records.encode_hello("ringllm_0_000000000000_no_such_ring")[0])
    bogus = np.zeros(3, records.REQUEST)  # and records of kinds it does not know
    bogus["kind"] = 99
    producer.write(bogus)
    with Client.connect(engine.instance_name) as client:
        assert run_together(client, [(PROMPTS[0], GREEDY)]) == [reference[0]]
    ring.close()
    assert engine.process.poll() is None


STUCK_CLIENT = """
import asyncio, os, signal, sys
from ringllm.pipeline import Client, SamplingParams
client = Client.connect(sys.argv[1])
params = SamplingParams(max_tokens=2000, ignore_eos=True)

async def one(i):
    try:
        async for out in client.agenerate([5, 6, 7, i], params):
            pass
        return "finished"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"

async def main():
    tasks = [asyncio.ensure_future(one(i)) for i in range(64)]
    while client.llm.num_unfinished_requests < 64:
        await asyncio.sleep(0.001)
    print("stopping", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # reads nothing more until SIGCONT
    for line in await asyncio.gather(*tasks):
        print(line, flush=True)

asyncio.run(main())
client.close()
"""


def process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0].decode()


def test_a_front_end_that_stops_reading_is_cut_off_and_the_others_are_served(engine, reference):
    """SIGSTOP a client with 64 long requests: its output ring fills, the engine keeps
    serving another client meanwhile, gives up on the stopped one after the backlog
    timeout (its requests aborted, their KV freed), and once it reads again it learns why."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK_CLIENT, engine.instance_name],
        stdout=subprocess.PIPE,
        text=True,
    )
    instance = InstanceSegment.attach(engine.instance_name)
    try:
        assert proc.stdout.readline().strip() == "stopping"
        deadline = time.monotonic() + 10
        while process_state(proc.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(proc.pid) == "T"
        with Client.connect(engine.instance_name) as client:
            # served while the stopped one's ring fills and after the engine gave up on it
            assert run_together(client, [(PROMPTS[1], GREEDY)]) == [reference[1]]
            assert wait_for_load(instance, (0, 0), timeout_s=60) == (0, 0)
            assert run_together(client, [(PROMPTS[2], GREEDY)]) == [reference[2]]
        proc.send_signal(signal.SIGCONT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        instance.close()
    lines = out.splitlines()
    assert len(lines) == 64
    assert all("read none of its outputs" in line for line in lines), lines[:3]
    assert all(line.startswith("RequestFailedError") for line in lines), lines[:3]
    assert engine.process.poll() is None
    cleanup_stale()


def test_front_ends_that_connect_and_leave_mid_step_cost_nothing(engine, reference):
    """While one client's requests run, others connect and leave (BYE, output ring
    unlinked): some at once, before the engine opened their ring, some with a long request
    running. The running ones come out exact; the leavers' requests are aborted."""
    with Client.connect(engine.instance_name) as client:

        async def churn():
            for i in range(12):
                other = RingCoreClient.connect(engine.instance_name)
                if i % 2:  # one with a request the engine has just taken in
                    from ringllm.pipeline.messages import EngineCoreRequest

                    long = SamplingParams(max_tokens=2000, ignore_eos=True)
                    other.add_request(
                        EngineCoreRequest(f"gone-{i}", [5, 6, 7], long, (), time.monotonic())
                    )
                    while other.get_outputs(timeout_s=5.0) is None:  # it is running now
                        pass
                other.shutdown()  # (an even one leaves before the engine opens its ring)
                await asyncio.sleep(0.01)

        async def both():
            jobs = [_run(client, p, GREEDY) for p in PROMPTS]
            return await asyncio.gather(*jobs, churn())

        got = asyncio.run(both())
    assert got[:3] == reference
    instance = InstanceSegment.attach(engine.instance_name)
    # the leavers' requests (2,000 steps each if they ran) were aborted as they left
    assert wait_for_load(instance, (0, 0), timeout_s=1.0) == (0, 0)
    instance.close()
    assert engine.process.poll() is None


def test_outputs_that_come_before_the_sender_runs_again_are_kept(engine, reference):
    """Under load the thread that sent an ADD may not run again before the engine answers
    it and the reader thread reads the answer. Made certain here: the sender sleeps right
    after the write. Every output must still reach the request (it once hung instead)."""
    from ringllm.pipeline.frontend.async_llm import AsyncLLM

    core = RingCoreClient.connect(engine.instance_name)
    send = core.producer.write_with_blob

    def send_then_stall(*args, **kwargs):
        send(*args, **kwargs)
        time.sleep(0.5)  # the engine runs the whole request meanwhile

    core.producer.write_with_blob = send_then_stall

    async def run():
        llm = AsyncLLM(EngineConfig.from_kwargs(model=str(engine.info.model_path)), core)
        try:
            outs = [o async for o in llm.generate(PROMPTS[0], GREEDY)]
            return outs[-1].outputs[0].token_ids, len(outs[-1].prompt_logprobs)
        finally:
            llm.shutdown()

    assert asyncio.run(asyncio.wait_for(run(), 30)) == reference[0]


def test_a_front_end_that_reads_slowly_holds_the_steps_instead_of_a_backlog(engine, monkeypatch):
    """A front end with a 64-slot ring that takes 4 records every 50 ms (slower than the
    engine makes them): the engine waits for it, so once its requests are aborted what
    is left to read is its ring and about a step, not what the engine could have made."""
    from ringllm.pipeline.engine import ring_client
    from ringllm.pipeline.messages import EngineCoreRequest

    monkeypatch.setattr(ring_client, "OUTPUT_RING_CAPACITY", 64)
    core = RingCoreClient.connect(engine.instance_name)
    long = SamplingParams(max_tokens=3000, ignore_eos=True)
    ids = [f"slow-{i}" for i in range(4)]
    try:
        for i, rid in enumerate(ids):
            core.add_request(EngineCoreRequest(rid, [5, 6, 7, i], long, (), time.monotonic()))
        read = 0
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            recs, _ = core.reader.read_with_blobs(4, timeout_s=0.05)
            read += int(np.count_nonzero(recs["kind"] == records.KIND_TOKENS))
            time.sleep(0.05)
        core.abort_requests(ids)
        left = 0
        while len(recs := core.reader.read_with_blobs(4096, timeout_s=0.5)[0]):
            left += int(np.count_nonzero(recs["kind"] == records.KIND_TOKENS))
    finally:
        core.shutdown()
    assert read > 40  # it was served all along
    assert left <= 64 + 3 * len(ids), left  # its ring, and the steps before the abort
    assert engine.process.poll() is None


def test_the_core_thread_waits_for_a_caller_that_does_not_read(model_path, reference):
    """The in-process core runs at most MAX_UNREAD_STEPS steps ahead of its reader, and
    goes on exactly where it stopped once it is read."""
    from ringllm.pipeline.engine.core_client import MAX_UNREAD_STEPS, make_core_client
    from ringllm.pipeline.messages import EngineCoreRequest

    core = make_core_client(EngineConfig.from_kwargs(**engine_args(model_path)), "thread")
    try:
        core.add_request(EngineCoreRequest("r", PROMPTS[0], GREEDY, (), time.monotonic()))
        time.sleep(1.0)  # the 24 steps take far less
        tokens, batches = [], 0
        while (outs := core.get_outputs(timeout_s=0)) is not None:
            batches += 1
            tokens += [t for o in outs.outputs for t in o.new_token_ids]
        assert 1 <= batches <= MAX_UNREAD_STEPS, batches
        while (outs := core.get_outputs(timeout_s=10)) is not None:
            tokens += [t for o in outs.outputs for t in o.new_token_ids]
            if any(o.finished for o in outs.outputs):
                break
    finally:
        core.shutdown()
    assert tokens == list(reference[0][0])
