"""Sleep mode in the model runner: the KV cache and the weights leave and come back, in the
layout they had (plain, oneDNN-packed, 16-bit panels, AMX tiles; 0-d tensors too), one
tensor held twice stays one, and the logits after waking are bit-identical to those before
sleeping."""

from __future__ import annotations

import os

import pytest
import torch

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.models.linear import layout
from ringllm.pipeline.worker.model_runner import LOGITS_ALL, ModelRunner, RunnerRequest
from ringllm.pipeline.worker.sleep import OffloadedWeights, weight_slots

PROMPT = list(range(3, 40))


LARGE = dict(hidden_size=256, intermediate_size=768)
SHAPES = {  # (architecture, its shape, the run's dtype)
    # matrices large enough to be packed: oneDNN's layout where it runs
    "packed": ("llama", dict(LARGE, dtype="float32"), "float32"),
    # a bfloat16 checkpoint computed in float32: the C kernels' panels where they run
    "panels": ("llama", dict(LARGE, dtype="bfloat16"), "float32"),
    # the same under auto: the AMX tile unit's tiles where this CPU has them
    "auto-bf16": ("llama", dict(LARGE, dtype="bfloat16"), "auto"),
    # small plain matrices; the tied head is the embedding tensor itself
    "plain-tied": ("llama", dict(), "float32"),
    # Gemma 3 holds 0-d tensors too
    "gemma3": ("gemma3", dict(), "float32"),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def runner(request, model_factory):
    arch, shape, dtype = SHAPES[request.param]
    path = model_factory(arch, tie_word_embeddings=True, **shape)
    config = EngineConfig.from_kwargs(
        model=str(path), dtype=dtype, num_gpu_blocks_override=16, enable_sleep_mode=True
    )
    runner = ModelRunner(config)
    runner.initialize_kv_cache(16)
    return runner


def logits_of(runner: ModelRunner) -> torch.Tensor:
    request = RunnerRequest(PROMPT, 0, list(range(3)), logits=LOGITS_ALL)
    return runner.execute([request]).logits.clone()


def layouts(runner: ModelRunner) -> list[str]:
    layer = runner.model.layers[0]
    return [layout(w) for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]


@pytest.mark.parametrize("level", [1, 2])
def test_logits_after_waking_are_those_before_sleeping(runner, level):
    before, kinds = logits_of(runner), layouts(runner)
    runner.sleep(level)
    assert runner.kv_caches == [] and runner.sleep_level == level
    with pytest.raises(RuntimeError, match="asleep"):
        logits_of(runner)
    runner.wake_up()
    assert runner.sleep_level == 0 and len(runner.kv_caches) == runner.arch.num_hidden_layers
    assert layouts(runner) == kinds
    assert torch.equal(logits_of(runner), before)


def test_level_1_then_2_goes_deeper_and_sleeping_again_changes_nothing(runner):
    before = logits_of(runner)
    runner.sleep(1)
    runner.sleep(1)  # asleep already: nothing
    runner.sleep(2)  # deeper: the offloaded copy is dropped too
    assert runner.model is None and runner._offloaded is None
    runner.wake_up()
    runner.wake_up()  # awake already: nothing
    assert torch.equal(logits_of(runner), before)
    with pytest.raises(ValueError, match="sleep level: 3"):
        runner.sleep(3)


def test_offloaded_weights_leave_the_model_and_keep_a_tied_tensor_one(runner):
    model = runner.model
    tied = model.embed is model.lm_head  # a plain tied head is one tensor held twice
    held = [slot.get() for slot in weight_slots(model)]
    assert len(held) > 4 * runner.arch.num_hidden_layers
    offloaded = OffloadedWeights(model)
    try:
        assert all(slot.get() is None for slot in offloaded.slots)
        assert offloaded.nbytes >= sum(
            t.numel() * t.element_size()
            for t in {id(t): t for t in held if isinstance(t, torch.Tensor) and not t.is_mkldnn}
            .values()
        )  # fmt: skip
        # the CPU copy lives in a file with no name: nothing is left on disk by a crash
        assert offloaded._file is not None
        assert not os.path.exists(os.readlink(f"/proc/self/fd/{offloaded._file.fileno()}"))
    finally:
        offloaded.restore()
    assert (model.embed is model.lm_head) == tied
    assert all(slot.get() is not None for slot in weight_slots(model))


@pytest.mark.parametrize(
    "level, order", [(1, ["weights", "kv_cache"]), (2, ["kv_cache", "weights"])]
)
def test_waking_in_parts(runner, level, order):
    """vLLM's wake_up(tags): one part at a time; the model runs again only with both back."""
    before = logits_of(runner)
    runner.sleep(level)
    runner.wake_up([order[0]])
    assert runner.sleep_level in (1, 2)
    with pytest.raises(RuntimeError, match="asleep"):
        logits_of(runner)
    runner.wake_up([order[0]])  # back already: nothing
    runner.wake_up([order[1]])
    assert runner.sleep_level == 0
    assert torch.equal(logits_of(runner), before)
    with pytest.raises(ValueError, match="tags"):
        runner.wake_up(["everything"])
