"""Structured outputs through the offline API, judged by oracles no one here wrote: every
JSON output validates with `jsonschema`, every regex output `re.fullmatch`es, every choice is
one of the choices, at temperature 1.0 over many seeds (random-weight models: left alone they
write anything, so only the grammar makes the outputs right). And the rest of the engine
keeps working under a grammar: n > 1, seeds, logprobs of the constrained distribution,
preemption, the rings, tensor parallelism, a restarted engine core."""

from __future__ import annotations

import json
import os
import re
import signal

import jsonschema
import pytest

from ringllm.pipeline import LLM, SamplingParams, StructuredOutputsParams
from ringllm.pipeline.engine import records
from ringllm.pipeline.messages import EngineCoreRequest

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,8}-\d{2,4}(\.[a-z]{1,3})?"
CHOICES = ["red", "green", "blue", "light grey"]
GRAMMAR = """
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]{0,2}/
"""
NUM_SEEDS = 48


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("llama")


@pytest.fixture(scope="module")
def llm(model):
    return LLM(str(model), dtype="float32", num_gpu_blocks_override=512, max_num_seqs=64)


def sampled(
    structured: StructuredOutputsParams, max_tokens: int = 160, **extra
) -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=max_tokens,
            structured_outputs=structured,
            **extra,
        )
        for seed in range(NUM_SEEDS)
    ]


def texts(llm, prompts, params) -> list:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [c for o in outs for c in o.outputs]


def test_every_json_schema_output_validates(llm):
    done = texts(
        llm, ["Describe a user as JSON:"] * NUM_SEEDS, sampled(StructuredOutputsParams(json=SCHEMA))
    )
    for c in done:
        assert c.finish_reason == "stop", c.text  # the grammar's end, not the length
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in done}) > NUM_SEEDS // 2  # sampled, not one forced string


def test_json_object_outputs_are_objects(llm):
    done = texts(
        llm, ["{"] * 16, sampled(StructuredOutputsParams(json_object=True), max_tokens=400)[:16]
    )
    finished = [c for c in done if c.finish_reason == "stop"]
    assert finished
    for c in finished:
        assert isinstance(json.loads(c.text), dict)


def test_every_regex_output_fullmatches(llm):
    for c in texts(llm, ["id:"] * NUM_SEEDS, sampled(StructuredOutputsParams(regex=REGEX))):
        assert c.finish_reason == "stop" and re.fullmatch(REGEX, c.text), c.text


def test_every_choice_output_is_a_choice(llm):
    done = texts(
        llm, ["Pick a colour:"] * NUM_SEEDS, sampled(StructuredOutputsParams(choice=CHOICES))
    )
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in done)
    assert len({c.text for c in done}) >= 2


def test_lark_grammar_outputs_parse(llm):
    expression = re.compile(r"[1-9][0-9]{0,2}|\(|\)|[+-]")
    for c in texts(
        llm, ["1+"] * 24, sampled(StructuredOutputsParams(grammar=GRAMMAR), max_tokens=200)[:24]
    ):
        if c.finish_reason != "stop":
            continue  # an expression may go on past max_tokens
        assert "".join(expression.findall(c.text)) == c.text
        assert eval(c.text) is not None  # noqa: S307 - digits, + - and brackets only


def test_n_logprobs_and_min_tokens_under_a_grammar(llm):
    params = SamplingParams(
        n=4, temperature=1.0, seed=7, max_tokens=20, logprobs=3, min_tokens=1,
        structured_outputs=StructuredOutputsParams(choice=CHOICES),
    )  # fmt: skip
    (out,) = llm.generate(["Pick:"], params, use_tqdm=False)
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert c.text in CHOICES
        for token, position in zip(c.token_ids, c.logprobs, strict=True):
            # logprobs of the constrained distribution: the sampled token is finite, and
            # tokens the grammar refused come last, at -inf
            assert position[token].logprob > float("-inf")
            ranked = sorted((lp for lp in position.values() if lp.rank), key=lambda lp: lp.rank)
            finite = [lp.logprob > float("-inf") for lp in ranked]
            assert finite == sorted(finite, reverse=True)
        # where the grammar leaves one token (inside a choice), its probability is 1: no
        # unconstrained random model gives that
        assert any(abs(p[t].logprob) < 1e-6 for t, p in zip(c.token_ids, c.logprobs, strict=True))


def test_greedy_is_the_same_in_process_over_the_rings_and_preempted(model, llm):
    """The mask applied in the worker over the rings and after preemption (a KV cache of
    a few blocks preempts constantly) gives the tokens it gives in process."""
    params = SamplingParams(
        temperature=0.0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    prompts = [f"User {i} as JSON:" for i in range(6)]
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(
        str(model), dtype="float32", num_gpu_blocks_override=512, multiprocess=True
    ) as over_rings:
        assert [
            o.outputs[0].text for o in over_rings.generate(prompts, params, use_tqdm=False)
        ] == expected
    tight = LLM(
        str(model), dtype="float32", num_gpu_blocks_override=24, block_size=16, max_num_seqs=6
    )
    assert [o.outputs[0].text for o in tight.generate(prompts, params, use_tqdm=False)] == expected
    assert tight.llm_engine.engine_core.scheduler.num_preemptions > 0
    for text in expected:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_tensor_parallel_ranks_apply_the_mask(model, llm):
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=SCHEMA)
        ),
        SamplingParams(
            temperature=1.0,
            seed=3,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(regex=REGEX),
        ),
        SamplingParams(temperature=0.0, max_tokens=12),  # unconstrained, in the same batch
    ]
    prompts = ["A user:", "An id:", "Hello"]
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(
        str(model), dtype="float32", num_gpu_blocks_override=512, tensor_parallel_size=2
    ) as tp:
        assert [o.outputs[0].text for o in tp.generate(prompts, params, use_tqdm=False)] == expected


def test_a_restarted_core_goes_on_inside_the_grammar(model, llm):
    """kill -9 mid-generation: the replayed request's new matcher first consumes what was
    delivered, so the output is the undisturbed one and still valid."""
    from ringllm.pipeline.config import EngineConfig
    from ringllm.pipeline.frontend.llm_engine import LLMEngine

    params = SamplingParams(
        temperature=0.0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    (expected,) = [o.outputs[0].text for o in llm.generate(["A user:"], params, use_tqdm=False)]
    engine = LLMEngine(
        EngineConfig.from_kwargs(model=str(model), dtype="float32", num_gpu_blocks_override=512),
        multiprocess=True,
    )
    try:
        engine.add_request("r", "A user:", params)
        final, killed = None, False
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
                if not killed and len(out.outputs[0].token_ids) >= 5:
                    os.kill(engine.core_client.engine_pid, signal.SIGKILL)
                    killed = True
        assert killed and engine.num_restarts == 1
    finally:
        engine.shutdown()
    assert final.outputs[0].text == expected


@pytest.mark.parametrize(
    "structured, message",
    [
        (
            StructuredOutputsParams(json={"type": "objectx"}),
            "structured_outputs.json: not a valid JSON Schema",
        ),
        (StructuredOutputsParams(regex="[a-z"), "structured_outputs.regex: cannot be enforced"),
        (
            StructuredOutputsParams(grammar="start: ("),
            "structured_outputs.grammar: cannot be enforced",
        ),
    ],
)
def test_a_spec_that_cannot_be_enforced_is_refused_naming_it(llm, structured, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(["x"], SamplingParams(structured_outputs=structured), use_tqdm=False)


def test_params_take_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})


@pytest.mark.parametrize(
    "structured",
    [
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(json_object=True, num_prefix_tokens=3),
        StructuredOutputsParams(regex=REGEX),
        StructuredOutputsParams(choice=["é", "ünïcode"]),
        StructuredOutputsParams(grammar=GRAMMAR),
    ],
)
def test_the_spec_crosses_the_request_ring_whole(structured):
    request = EngineCoreRequest(
        "req-é", [1, 2, 3], SamplingParams(structured_outputs=structured), (0,), 1.0, 0, "g"
    )
    decoded = records.decode_add(*records.encode_add(5, request))
    assert decoded.sampling_params.structured_outputs.spec() == structured.spec()
    assert (
        decoded.sampling_params.structured_outputs.num_prefix_tokens == structured.num_prefix_tokens
    )
    assert (decoded.request_id, decoded.group_id, decoded.prompt_token_ids) == (
        "req-é",
        "g",
        [1, 2, 3],
    )


def test_data_parallel_cores_and_the_ipc_client_enforce_it(model, llm):
    """Each DP core compiles and masks for the requests routed to it; a program attached by
    name (the IPC Client) sends its spec over the rings like any front end."""
    from ringllm.pipeline import Client

    params = SamplingParams(
        temperature=0.0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    prompts = [f"User {i} as JSON:" for i in range(4)]
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(
        str(model), dtype="float32", num_gpu_blocks_override=256, data_parallel_size=2,
        multiprocess=True,
    ) as dp:  # fmt: skip
        assert [o.outputs[0].text for o in dp.generate(prompts, params, use_tqdm=False)] == expected
        name = dp.llm_engine.core_client.clients[0].instance_name
        with Client.connect(name) as client:
            final = list(client.generate(prompts[0], params))[-1]
    assert final.outputs[0].text == expected[0]


def test_chunked_prefill_masks_only_the_last_chunk(model, llm):
    """A long prompt computed 16 tokens a step: only the step that reaches its end samples,
    so only that one gets a mask row; the outputs are those of one-step prefill."""
    params = SamplingParams(
        temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(regex=REGEX)
    )
    prompts = [f"record {i} " * 30 for i in range(3)]
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    chunked = LLM(
        str(model), dtype="float32", num_gpu_blocks_override=512, max_num_batched_tokens=16,
    )  # fmt: skip
    got = [o.outputs[0].text for o in chunked.generate(prompts, params, use_tqdm=False)]
    assert got == expected and all(re.fullmatch(REGEX, t) for t in got)


def test_aborting_a_request_whose_grammar_still_compiles(model):
    """Aborted while its grammar compiles: it leaves no trace (no output, no queued request,
    nothing pending), and the engine goes on with the next."""
    from ringllm.pipeline.config import EngineConfig
    from ringllm.pipeline.frontend.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig.from_kwargs(model=str(model), dtype="float32", num_gpu_blocks_override=64)
    )
    schema = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(200)}}
    engine.add_request(
        "big", "x", SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    )
    scheduler = engine.engine_core.scheduler
    assert scheduler.num_compiling == 1
    engine.abort_request("big")
    assert scheduler.num_compiling == 0 and not scheduler.has_unfinished_requests()
    params = SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[ab]{4}")
    )
    engine.add_request("next", "x", params)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    assert set(outs) == {"next"} and re.fullmatch("[ab]{4}", outs["next"].outputs[0].text)
