"""Timing hooks inside one in-process `Worker`, for `ringllm bench step`.

`instrument(worker, timed)` wraps, for as long as the context lasts, every call the worker
makes of: the ops (attention, RMSNorm, rotary, KV write, SiLU- or GELU-and-mul), the layers' matrix
products, a mixture of experts' sparse MLPs (routing and the experts' products), the model's forward pass, the logits product, the sampler and the whole
`execute`, each with `timed(label, fn)` (the caller's timer); a decode step whose layers run
in one C call (models/decode_plan.py) has that call timed instead of the layers' ops, and
the call itself tells where its time went (decode_plan.PROFILE_PARTS: the norms, each
product, attention...): the context yields a dict that holds those parts' seconds, summed
over the calls, once the context ends. What `execute` spends outside
the forward pass, the logits and the sampler is the runner's host work: building the
step's inputs from the scheduler's diff and turning sampled rows into results.

It lives here, beside the worker, because it reaches into the worker's runner and model:
nothing outside pipeline/worker/ does.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

OPS_TIMED = {
    "paged_attention_decode": "attention",
    "paged_attention_prefill": "attention",
    "rms_norm": "rms_norm",
    "rotary_embedding": "rotary_embedding",
    "reshape_and_cache": "reshape_and_cache",
    "silu_and_mul": "silu_and_mul",
    "gelu_tanh_and_mul": "gelu_tanh_and_mul",
}
Timer = Callable[[str, Callable], Callable]


class _TimedOps:
    def __init__(self, ops, timed: Timer) -> None:
        self._ops, self._timed = ops, timed
        self.name = ops.name

    def __getattr__(self, name):
        attr = getattr(self._ops, name)
        return self._timed(OPS_TIMED[name], attr) if name in OPS_TIMED else attr


@contextmanager
def instrument(worker, timed: Timer):
    """See the module docstring; `worker` must be an in-process `Worker`."""
    from ringllm.pipeline.models import llama

    runner = getattr(worker, "runner", None)
    if runner is None:
        raise ValueError("profiling needs the model in this process (tensor_parallel_size 1)")
    model = runner.model
    saved = (llama.linear, model.compute_logits, model.forward, model.ops)
    saved_sample, saved_execute = worker.sampler.sample, worker.execute
    layer_linear = timed("linear (layers)", saved[0])
    lm_head = timed("lm_head", saved[1])

    def compute_logits(hidden):
        llama.linear = saved[0]  # the logits product counts as lm_head, not as a layer's
        try:
            return lm_head(hidden)
        finally:
            llama.linear = layer_linear

    from ringllm.pipeline.models.moe import MoeWeights

    saved_experts = MoeWeights.forward
    if any(getattr(w, "moe", None) is not None for w in getattr(model, "layers", [])):
        # the ops inside untimed: the sparse MLP's SiLU counts once, as the experts'
        def experts(moe, ops, h, _forward=saved_experts, _ops=saved[3]):
            return _forward(moe, _ops, h)

        MoeWeights.forward = timed("experts (routing and products)", experts)
    llama.linear = layer_linear
    model.compute_logits = compute_logits
    model.forward = timed("model forward", saved[2])
    model._fused_layers = timed("decoder layers, one C call", model._fused_layers)
    from ringllm.pipeline.models.decode_plan import PROFILE_PARTS, new_profile

    model.decode_profile = new_profile()
    inside: dict[str, float] = {}
    model.ops = runner.ops = _TimedOps(saved[3], timed)
    worker.sampler.sample = timed("sampler", saved_sample)
    worker.execute = timed("worker execute", saved_execute)
    try:
        yield inside
    finally:
        seconds = model.decode_profile.tolist()
        inside.update((part, s) for part, s in zip(PROFILE_PARTS, seconds, strict=True) if s > 0)
        model.decode_profile = None
        MoeWeights.forward = saved_experts
        llama.linear, model.compute_logits = saved[0], saved[1]
        model.forward, model.ops = saved[2], saved[3]
        runner.ops = saved[3]
        del model._fused_layers  # back to the class's method
        worker.sampler.sample = saved_sample
        del worker.execute  # back to the class's method
