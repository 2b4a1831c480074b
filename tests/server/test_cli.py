"""`ringllm serve` as a command: its flags, its startup lines, and SIGINT / SIGTERM."""

from __future__ import annotations

import argparse
import re
import signal
import urllib.request
from pathlib import Path

import pytest

from ringllm.server.cli import _engine_config, configure_parser


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return parser.parse_args(argv)


def test_flags_reach_the_engine_config():
    args = parse(["/m", "--port", "0", "--api-key", "k", "--max-num-seqs", "8", "--dtype", "float32",
                  "--served-model-name", "mine", "--no-enable-prefix-caching"])  # fmt: skip
    config = _engine_config(args)
    assert config.model.model == "/m" and config.model.dtype == "float32"
    assert config.model.served_model_name == "mine"
    assert config.scheduler.max_num_seqs == 8
    assert config.cache.enable_prefix_caching is False
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 0, "k")
    assert _engine_config(parse([])).model.model is None  # the demo model


def test_model_given_twice_differently_is_refused():
    with pytest.raises(SystemExit, match="disagree"):
        _engine_config(parse(["/a", "--model", "/b"]))


@pytest.mark.parametrize(
    "placement,stop_signal",
    [("--no-engine-process", signal.SIGINT), ("--engine-process", signal.SIGINT)],
    ids=["core-thread", "core-process"],
)
def test_prints_url_and_stops_cleanly_on_sigint(
    launch_server, server_model, placement, stop_signal
):
    args = [str(server_model), "--port", "0", placement, "--dtype", "float32",
            "--num-gpu-blocks-override", "64"]  # fmt: skip
    with launch_server(args, stop_signal) as (_, url, log_path):
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url) and not url.endswith(":0")
        with urllib.request.urlopen(url + "/health") as response:
            assert response.status == 200
        # no --api-key: the API is open
        with urllib.request.urlopen(url + "/v1/models") as response:
            assert Path(server_model).name.encode() in response.read()
        log = log_path.read_text()
        instance = re.search(r"engine IPC instance (\S+)", log)
        assert (instance is not None) == (placement == "--engine-process")
    assert "shutting down" in log_path.read_text()
    if instance is not None:
        assert not list(Path("/dev/shm").glob(instance.group(1) + "*"))
