"""`--distributed-executor-backend ray`: the ranks as Ray actors in a placement group.

On a local Ray instance the engine starts itself (one host), and on a Ray cluster spanning
two "hosts" (network namespaces, tests/hosts/netns.py: `ray start --head` in one, `ray
start --address` in the other, a token of the test's own), the greedy tokens equal the
offline single-process engine's, through `ringllm serve` and the `openai` client for the
cluster, for PP=2 and TP=2. Bundles of 2 CPUs on hosts of 2 CPUs put one rank on each
host, so the batch records cross to the second host through its relay actor.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import openai
import pytest

from ringllm.pipeline import LLM
from tests.hosts.conftest import ENGINE, GREEDY, PROMPTS, URL_LINE
from tests.hosts.netns import hosts_unavailable, make_hosts, wait_for_line

ray = pytest.importorskip("ray", reason="needs ray: pip install 'ringllm[ray]'")

RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture(scope="module")
def expected(offline_outputs):
    return [o.token_ids for o in offline_outputs]


def test_a_local_ray_instance(model, expected):
    """No cluster named: the executor starts a local Ray instance, and stops it after."""
    params = dict(dtype="float32", max_model_len=512, distributed_executor_backend="ray")
    with LLM(model, pipeline_parallel_size=2, **params) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == expected
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def ray_cluster():
    """Two hosts (network namespaces) in one Ray cluster, shared by the tests that run a
    server across them: (the head host, the environment its clients need)."""
    env = dict(
        os.environ,
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(16),
        RAY_USAGE_STATS_ENABLED="0",
    )
    temp = tempfile.mkdtemp(prefix="rlray")  # short: Ray's socket paths must fit 107 bytes
    with make_hosts(2) as (head, other):
        port = "6399"
        started = []
        try:
            for host, args in (
                (head, ["--head", f"--port={port}", "--include-dashboard=false"]),
                (other, [f"--address={head.address}:{port}"]),
            ):
                done = subprocess.run(
                    ["ip", "netns", "exec", host.namespace, RAY, "start", *args,
                     f"--node-ip-address={host.address}", "--num-cpus=2",
                     f"--temp-dir={temp}/{host.namespace}", "--disable-usage-stats"],
                    env=env, capture_output=True, text=True, timeout=120,
                )  # fmt: skip
                assert done.returncode == 0, done.stderr[-3000:]
                started.append(host)
            yield head, dict(env, RAY_ADDRESS=f"{head.address}:{port}")
        finally:
            for host in reversed(started):
                subprocess.run(
                    ["ip", "netns", "exec", host.namespace, RAY, "stop", "--force"],
                    env=env, capture_output=True, timeout=120,
                )  # fmt: skip
            shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.skipif(hosts_unavailable() is not None, reason=str(hosts_unavailable()))
@pytest.mark.parametrize(
    "parallel",
    # slow variants both: parallelism across hosts is the mp executor's default test
    # (test_multi_host.py), Ray's placement the local instance's and the killed actor's
    [
        pytest.param(["--pipeline-parallel-size", "2"], marks=pytest.mark.slow),
        pytest.param(["--tensor-parallel-size", "2"], marks=pytest.mark.slow),
    ],
    ids=["pp2", "tp2"],
)
def test_a_ray_cluster_across_two_hosts(model, offline_outputs, tmp_path, parallel, ray_cluster):
    head, env = ray_cluster
    log_path = tmp_path / "head.log"
    with open(log_path, "wb") as log:
        server = head.popen(
            [sys.executable, "-m", "ringllm.server.cli", model, "--host", head.address,
             "--port", "0", "--distributed-executor-backend", "ray", *parallel,
             "--num-threads", "2", *ENGINE],
            stdout=log, stderr=log, env=env,
        )  # fmt: skip
    try:
        url = URL_LINE.search(wait_for_line(log_path, "listening on", server)).group(1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        name = client.models.list().data[0].id
        got = client.completions.create(
            model=name, prompt=PROMPTS, max_tokens=16, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        texts = [c.text for c in sorted(got.choices, key=lambda c: c.index)]
        assert texts == [o.text for o in offline_outputs]
        assert "on 2 host(s): [1, 1] per host" in log_path.read_text(errors="replace")
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0, log_path.read_text(errors="replace")[-3000:]
    finally:
        if server.poll() is None:  # a failed check: the server's whole group goes
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_a_killed_rank_actor_is_a_clear_error(model):
    """A rank actor's process SIGKILLed: the next steps end with the same EngineDeadError
    as a dead rank process, within a couple of seconds, and nothing is left running."""
    import time

    from ringllm.pipeline.config import EngineConfig
    from ringllm.pipeline.engine.engine_core import EngineCore
    from ringllm.pipeline.errors import EngineDeadError
    from ringllm.pipeline.messages import EngineCoreRequest
    from ringllm.pipeline.sampling_params import SamplingParams

    config = EngineConfig.from_kwargs(
        model=model, dtype="float32", max_model_len=512, pipeline_parallel_size=2,
        distributed_executor_backend="ray",
    )  # fmt: skip
    core = EngineCore(config)
    try:
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        core.add_request(EngineCoreRequest("r", list(range(3, 40)), params, (), 0.0))
        core.step()
        os.kill(core.executor.pids[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="rank 1"):
            for _ in range(10_000):
                core.step()
        assert time.monotonic() - started < 3.0
    finally:
        core.shutdown()
    assert not ray.is_initialized()
