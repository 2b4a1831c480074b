"""The grammar backend's parts on their own: the C bitmask pass against the torch reference,
the bitmask layout against llguidance's own allowed tokens, the compile manager (cache,
failures, timeout), and the early check's messages."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from ringllm.pipeline.core.request import Request
from ringllm.pipeline.core.structured_output import StructuredOutputManager
from ringllm.pipeline.sample.grammar_mask import allowed_tokens, apply_bitmask, apply_bitmask_torch
from ringllm.pipeline.sampling_params import SamplingParams
from ringllm.pipeline.structured.grammar import GuidanceBackend, bitmask_words, check_spec
from ringllm.pipeline.structured.params import StructuredOutputsParams


@pytest.mark.parametrize("vocab", [31, 32, 100, 4099])
@pytest.mark.parametrize("kind", ["none", "all", "random", "sparse"])
def test_the_c_pass_equals_the_torch_reference(vocab, kind):
    rng = np.random.default_rng(vocab)
    words = bitmask_words(vocab)
    if kind == "none":
        mask = np.zeros((9, words), np.int32)
    elif kind == "all":
        mask = np.full((9, words), -1, np.int32)
    elif kind == "random":
        mask = rng.integers(-(2**31), 2**31, size=(9, words), dtype=np.int64).astype(np.int32)
    else:
        bits = rng.random((9, words * 32)) < 0.01
        mask = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    logits = torch.randn(9, vocab)
    ours, reference = logits.clone(), logits.clone()
    apply_bitmask(ours, mask)
    apply_bitmask_torch(reference, mask)
    assert torch.equal(ours, reference)
    allowed = allowed_tokens(mask, vocab)
    assert torch.equal(torch.isfinite(ours), torch.from_numpy(allowed))
    # a strided view (rows of a wider tensor) takes the torch path and agrees
    wide = torch.randn(9, vocab + 7)
    view, copy = wide[:, :vocab], wide[:, :vocab].clone()
    apply_bitmask(view, mask)
    apply_bitmask_torch(copy, mask)
    assert torch.equal(view, copy)


@pytest.fixture(scope="module")
def backend(model_factory):
    path = model_factory("llama")
    config = json.loads((path / "config.json").read_text())
    return GuidanceBackend((path / "tokenizer.json").read_text(), config["vocab_size"], [0])


def test_a_row_allows_what_the_grammar_allows(backend):
    """The bitmask layout: the tokens of the row are those llguidance accepts one by one."""
    matcher = backend.compile("choice", json.dumps(["abc", "abd", "xyz"])).matcher()
    mask = np.zeros((1, bitmask_words(backend.vocab_size)), np.int32)
    backend.fill_bitmasks([(matcher, 0)], mask)
    allowed = np.flatnonzero(allowed_tokens(mask, backend.vocab_size)[0])
    assert 0 < len(allowed) < backend.vocab_size
    for token in range(backend.vocab_size):
        probe = matcher.copy()
        assert probe.accept([token]) == (token in set(allowed.tolist())), token


def request_with(structured: StructuredOutputsParams, prompt=(5, 6, 7)) -> Request:
    return Request(
        f"r{time.monotonic_ns()}", list(prompt), SamplingParams(structured_outputs=structured)
    )


def wait_ready(manager: StructuredOutputManager, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    ready, failed = [], []
    while manager.num_pending and time.monotonic() < deadline:
        got_ready, got_failed = manager.take_ready()
        ready += got_ready
        failed += got_failed
        time.sleep(0.001)
    return ready, failed


def test_the_manager_compiles_once_per_spec_and_reports_failures(backend):
    calls = []

    class Counting:
        vocab_size = backend.vocab_size

        def compile(self, kind, text):
            calls.append(kind)
            return backend.compile(kind, text)

        def fill_bitmasks(self, matchers, bitmask):
            backend.fill_bitmasks(matchers, bitmask)

    manager = StructuredOutputManager(Counting, compile_timeout_s=30)
    try:
        same = [request_with(StructuredOutputsParams(regex="[ab]{3}")) for _ in range(5)]
        broken = request_with(StructuredOutputsParams(regex="[a-"))
        for r in [*same, broken]:
            manager.submit(r)
        ready, failed = wait_ready(manager)
        assert sorted(r.request_id for r in ready) == sorted(r.request_id for r in same)
        assert calls.count("regex") == 2  # one compile per distinct spec
        assert [(r.request_id, "cannot be enforced" in m) for r, m in failed] == [
            (broken.request_id, True)
        ]
        assert len({id(r.matcher) for r in ready}) == 5  # each its own matcher
        mask = manager.fill_bitmask(ready)
        assert mask.shape == (5, bitmask_words(backend.vocab_size)) and (mask == mask[0]).all()
    finally:
        manager.shutdown()


def test_a_compile_past_its_time_is_refused():
    def slow_backend():
        time.sleep(0.5)
        raise AssertionError("never reached in time")

    manager = StructuredOutputManager(slow_backend, compile_timeout_s=0.05)
    try:
        request = request_with(StructuredOutputsParams(json_object=True))
        manager.submit(request)
        _, failed = wait_ready(manager)
        ((who, message),) = failed
        assert who is request and "did not compile within 0.05 s" in message
    finally:
        manager.shutdown()


def test_a_replayed_request_starts_after_its_delivered_tokens(backend):
    """num_prefix_tokens: the matcher consumes the prompt's last tokens (what the request
    had produced before its engine died) before it constrains anything."""
    grammar = backend.compile("choice", json.dumps(["abc"]))
    probe = grammar.matcher()
    mask = np.zeros((1, bitmask_words(backend.vocab_size)), np.int32)
    backend.fill_bitmasks([(probe, 0)], mask)
    allowed = set(np.flatnonzero(allowed_tokens(mask, backend.vocab_size)[0]).tolist())
    first = min(allowed)
    refused = next(t for t in range(backend.vocab_size) if t not in allowed)
    manager = StructuredOutputManager(lambda: backend, compile_timeout_s=30)
    try:
        fine = request_with(
            StructuredOutputsParams(choice=["abc"], num_prefix_tokens=1), prompt=(9, first)
        )
        wrong = request_with(
            StructuredOutputsParams(choice=["abc"], num_prefix_tokens=1), prompt=(9, refused)
        )
        manager.submit(fine)
        manager.submit(wrong)
        ready, failed = wait_ready(manager)
        assert ready == [fine] and [r for r, _ in failed] == [wrong]
    finally:
        manager.shutdown()


@pytest.mark.parametrize(
    "kind, text, words",
    [
        (
            "json",
            json.dumps({"type": "array", "items": {"type": 12}}),
            "not a valid JSON Schema at items/type",
        ),
        ("json", json.dumps({"type": "string", "pattern": "(("}), "not a valid JSON Schema"),
        ("json", json.dumps({"type": "array", "uniqueItems": True}), "Unimplemented keys"),
        ("json", json.dumps({"not": {"type": "string"}}), "Unimplemented keys"),
        ("regex", "(unclosed", "structured_outputs.regex: cannot be enforced"),
        ("grammar", "start: undefined_rule", "structured_outputs.grammar: cannot be enforced"),
    ],
)
def test_the_early_check_names_the_problem(kind, text, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        check_spec(kind, text)
