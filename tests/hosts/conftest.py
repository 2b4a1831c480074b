"""What the several-hosts tests share: the model, its offline outputs (the oracle), the
engine flags and prompts, and `TwoHosts` (a head and one headless host, started as a user
starts them)."""

from __future__ import annotations

import re
import signal
import sys
import time

import openai
import pytest

from ringllm.pipeline import LLM, SamplingParams
from tests.hosts.netns import wait_for_line

ENGINE = ["--dtype", "float32", "--max-model-len", "512", "--swap-space", "0"]
PROMPTS = [f"Number {i} is followed by" for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
URL_LINE = re.compile(r"listening on (http://\S+)")
CLI = [sys.executable, "-m", "ringllm.server.cli"]


@pytest.fixture(scope="session")
def model(model_factory):
    return str(model_factory("llama", num_layers=4))


@pytest.fixture(scope="session")
def offline_outputs(model):
    """The single-process engine's greedy completions of PROMPTS."""
    with LLM(model, dtype="float32", max_model_len=512) as llm:
        return [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


class TwoHosts:
    """The head and one headless host, started with `parallel` flags."""

    def __init__(self, hosts, model: str, parallel: list[str], log_dir, extra=()) -> None:
        self.head, self.other = hosts
        port = str(29000 + int(time.monotonic() * 1000) % 900)
        self.common = [
            model, "--nnodes", "2", "--master-addr", self.head.address, "--master-port", port,
            *parallel, *ENGINE,
        ]  # fmt: skip
        self.log_dir = log_dir
        self.other_log = log_dir / "headless.log"
        self.head_log = log_dir / "head.log"
        self.start_agent()
        with open(self.head_log, "wb") as log:
            self.server = self.head.popen(
                [*CLI, *self.common, "--host", self.head.address, "--port", "0", *extra],
                stdout=log,
                stderr=log,
            )
        line = wait_for_line(self.head_log, "listening on", self.server)
        self.url = URL_LINE.search(line).group(1)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)
        self.model = self.client.models.list().data[0].id

    def start_agent(self) -> None:
        """`ringllm serve --headless --node-rank 1` on the other host (again, after it died:
        its log is then headless-N.log)."""
        if self.other_log.exists():
            self.other_log = self.log_dir / f"headless-{len(self.other.procs)}.log"
        with open(self.other_log, "wb") as log:
            self.agent = self.other.popen(
                [*CLI, *self.common, "--headless", "--node-rank", "1"], stdout=log, stderr=log
            )

    def complete(self, prompts, max_tokens=16) -> list[str]:
        got = self.client.completions.create(
            model=self.model, prompt=prompts, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return [c.text for c in sorted(got.choices, key=lambda c: c.index)]

    def stream(self, prompt: str, max_tokens: int = 16) -> str:
        stream = self.client.completions.create(
            model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return "".join(chunk.choices[0].text for chunk in stream)

    def stop(self) -> None:
        """SIGTERM to both: each exits 0 and leaves no shared memory behind."""
        for proc in (self.server, self.agent):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(timeout=30) for proc in (self.server, self.agent)]
        logs = self.head_log.read_text(errors="replace")[-3000:]
        assert codes == [0, 0], (codes, logs, self.other_log.read_text(errors="replace")[-3000:])
