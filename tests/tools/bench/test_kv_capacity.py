"""`ringllm bench kv-capacity` on the tiny Gemma 3 (five sliding layers of 16 keys to one
global): counts and consistency only, never timings."""

from __future__ import annotations

import json

from ringllm.tools.cli import main


def test_sliding_layers_hold_more_sequences_in_the_same_bytes(model_factory, tmp_path, capsys):
    out = tmp_path / "kv.json"
    # 96-token sequences (6 blocks) in 24 blocks of all 6 layers' bytes: 4 at once; one
    # layer's blocks: 144, a sequence decoding holding 6 + 5 x 2 (its window of 16 keys)
    argv = ["bench", "kv-capacity", "--model", str(model_factory("gemma3")),
            "--dtype", "float32", "--context-len", "96", "--output-len", "40",
            "--num-requests", "12", "--max-num-batched-tokens", "16",
            "--kv-cache-memory-bytes", str(24 * 6 * 4096), "--result-json", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    hybrid, full = result["runs"]["hybrid"], result["runs"]["every block"]
    assert (full["num_blocks"], hybrid["num_blocks"]) == (24, 144)
    # decoding, a sliding group holds 2 blocks; prefilling a chunk of 16, one more each
    assert (full["predicted"], hybrid["predicted"]) == (4, (143 - 5) // 16)
    assert full["peak_tokens"] <= 24 * 16 < hybrid["peak_tokens"]
    assert result["tokens_held_ratio"] == hybrid["peak_tokens"] / full["peak_tokens"] > 1.5
    assert hybrid["peak_running"] > full["peak_running"]
    assert result["first_request_same_tokens"]
    assert result["first_request_max_logprob_diff"] < 1e-5
    assert "KV Cache Capacity Benchmark" in capsys.readouterr().out


def test_refuses_what_it_cannot_measure(model_factory, capsys):
    model = str(model_factory("gemma3"))
    argv = ["bench", "kv-capacity", "--model", model]
    assert main([*argv, "--disable-hybrid-kv-cache-manager"]) == 2
    assert "leave it off" in capsys.readouterr().err
    assert main([*argv, "--context-len", "8", "--output-len", "8"]) == 2
    assert "output_len: 8 tokens leave no prompt" in capsys.readouterr().err
