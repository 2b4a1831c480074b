"""`ringllm bench hosts` on a tiny model: a second "host" on loopback (a headless agent this
bench starts), one host against two for PP=2; the figures are there and positive, a bad
layout is refused by name."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def model(model_factory):
    return str(model_factory("llama", num_layers=2))


@pytest.mark.slow  # a benchmark over two network namespaces
def test_one_host_against_two(model, tmp_path):
    out = tmp_path / "hosts.json"
    done = subprocess.run(
        [sys.executable, "-m", "ringllm.tools.cli", "bench", "hosts", "--model", model,
         "--dtype", "float32", "--swap-space", "0", "--layouts", "pp2", "--input-len", "8",
         "--output-len", "12", "--num-iters", "1", "--master-port", "29731",
         "--result-json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())["layouts"]["pp2"]
    assert figures["one_host_step_ms"] > 0 and figures["two_hosts_step_ms"] > 0
    assert figures["hop_ms"] == pytest.approx(
        figures["two_hosts_step_ms"] - figures["one_host_step_ms"]
    )


def test_a_bad_layout_is_refused():
    done = subprocess.run(
        [sys.executable, "-m", "ringllm.tools.cli", "bench", "hosts", "--layouts", "pp9"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0 and "layouts: 'pp9' must list some of" in done.stderr
