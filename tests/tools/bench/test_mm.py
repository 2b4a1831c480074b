"""`ringllm bench mm` on a tiny random LLaVA: it runs, its result is complete and
consistent (both kinds of prompt the same length, every round counted), and a model that
takes no images is refused. Behaviour only, never timings."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from ringllm.tools.bench import commands as bench
from ringllm.tools.make_model import ModelShape, make_model

NUM_IMAGE_TOKENS = 16


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("llava"), ModelShape(arch="llava"))


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ringllm")
    bench.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "mm", *argv])
    return args.func(args)


def run_bench(model, tmp_path, *extra: str) -> dict:
    out = tmp_path / "mm.json"
    argv = [
        "--model", str(model), "--dtype", "float32", "--num-iters", "2",
        "--num-iters-warmup", "1", "--batch-size", "3", "--output-len", "4",
        "--result-json", str(out), *extra,
    ]  # fmt: skip
    assert run_cli(argv) == 0
    return json.loads(out.read_text())


def test_result_is_complete_and_consistent(llava, tmp_path, capsys):
    result = run_bench(llava, tmp_path, "--input-len", "12", "--image-size", "48x40")
    table = capsys.readouterr().out
    assert "Encoder share of TTFT (%)" in table and "NOTE" not in table
    assert result["num_image_tokens"] == NUM_IMAGE_TOKENS
    assert result["image_size"] == [48, 40]
    # the text prompt is as long as the expanded image prompt
    assert result["prompt_len"] == {"image": 12 + NUM_IMAGE_TOKENS, "text": 12 + NUM_IMAGE_TOKENS}
    for kind in ("image", "text"):
        ttft = result["ttft_runs"][kind]
        assert len(ttft["ttft_s"]) == len(ttft["engine_ttft_s"]) == 2
        assert all(0 < e <= w for e, w in zip(ttft["engine_ttft_s"], ttft["ttft_s"], strict=True))
        batch = result["throughput_runs"][kind]
        assert batch["output_tokens"] == [3 * 4, 3 * 4]  # EOS ignored: every token made
        assert result[f"{kind}_output_tok_s"] > 0 and result[f"{kind}_requests_s"] > 0
    # the encoder runs for images only, inside the request it serves
    assert len(result["ttft_runs"]["image"]["encode_s"]) == 2
    assert all(s > 0 for s in result["ttft_runs"]["image"]["encode_s"])
    assert result["ttft_runs"]["text"]["encode_s"] == [0.0, 0.0]
    assert result["throughput_runs"]["text"]["encode_s"] == [0.0, 0.0]
    for key in ("encoder_share_of_ttft", "encoder_share_of_engine_ttft", "encoder_share_of_batch"):
        assert 0 < result[key] < 1, key
    assert math.isclose(
        result["ttft_ratio"], result["median_ttft_image_ms"] / result["median_ttft_text_ms"]
    )
    assert math.isclose(
        result["throughput_ratio"], result["image_output_tok_s"] / result["text_output_tok_s"]
    )
    assert result["config"]["workload"]["num_images"] == 1
    assert "multimodal" in result["config"]["engine"]
    assert result["machine_before"]["cpu_isa"]


def test_two_images_and_the_model_size_by_default(llava, tmp_path):
    result = run_bench(llava, tmp_path, "--input-len", "5", "--random-mm-num-images", "2")
    assert result["image_size"] == [32, 32]  # the tiny tower's own input size
    assert result["prompt_len"]["image"] == result["prompt_len"]["text"] == 5 + 2 * 16


def test_a_text_only_model_is_refused(model_factory, tmp_path):
    with pytest.raises(ValueError, match="takes no images"):
        run_cli(["--model", str(model_factory("llama")), "--num-iters", "1"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--num-images", "0"), "num_images"),
        (("--image-size", "big"), "random_mm_image_size"),
        (("--num-iters", "0"), "num_iters"),
    ],
)
def test_bad_flags_fail_before_the_engine_starts(flags, message):
    with pytest.raises(ValueError, match=message):
        run_cli(["--model", "/nonexistent", *flags])
