"""Images through the engine: EngineCoreRequests with images, scheduled, encoded once,
merged and decoded, against transformers' own LlavaForConditionalGeneration.

The model is a tiny random LLaVA saved by transformers (tests/pipeline/models/test_llava.py
makes it); prompts carry one and two images; a small token budget splits prefill inside
images, a small encoder budget delays the second image of a prompt, a small KV cache
preempts; every greedy token must equal transformers' `generate`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.engine.engine_core import EngineCore
from ringllm.pipeline.messages import EngineCoreRequest, ImageInput
from ringllm.pipeline.sampling_params import SamplingParams
from tests.pipeline.models.test_llava import IMAGE_TOKEN, TOKEN_IDS_BELOW, make_hf_llava

NUM_IMAGE_TOKENS = 16
IMAGE_SIZE = 32
NUM_NEW = 24


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llava-hf")
    hf = make_hf_llava(folder)
    hf.generation_config.eos_token_id = None
    return folder, hf


def image_request(rid, pieces, seed, max_tokens=NUM_NEW, **params) -> EngineCoreRequest:
    """pieces: text lengths and "image"s (an int after "image" is that image's seed)."""
    g = torch.Generator().manual_seed(seed)
    ids, images = [], []
    for piece in pieces:
        if isinstance(piece, str):  # "image" or "image:<seed>"
            image_seed = int(piece.split(":")[1]) if ":" in piece else seed * 100 + len(images)
            pixels = torch.randn(
                3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(image_seed)
            )
            images.append(ImageInput.from_pixels(len(ids), NUM_IMAGE_TOKENS, pixels.numpy()))
            ids += [IMAGE_TOKEN] * NUM_IMAGE_TOKENS
        else:
            ids += torch.randint(0, TOKEN_IDS_BELOW, (piece,), generator=g).tolist()
    return EngineCoreRequest(
        rid,
        ids,
        SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),
        (),
        0.0,
        mm_inputs=tuple(images),
    )


def transformers_tokens(hf, request: EngineCoreRequest, num_new=NUM_NEW) -> list[int]:
    """Greedy tokens by transformers' full forward over the whole sequence at every step
    (no KV cache: the definition of greedy decoding; on some of these prompts transformers'
    own cached `generate` picks another token than its full forward does)."""
    images = {}
    if request.mm_inputs:
        images["pixel_values"] = torch.from_numpy(
            np.stack([m.pixel_values for m in request.mm_inputs])
        )
    ids = list(request.prompt_token_ids)
    with torch.no_grad():
        for _ in range(num_new):
            logits = hf(input_ids=torch.tensor([ids]), **images).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(request.prompt_token_ids) :]


def make_core(folder, **kwargs) -> EngineCore:
    args = dict(model=str(folder), dtype="float32", block_size=8, max_num_batched_tokens=64)
    args.update(kwargs)
    return EngineCore(EngineConfig.from_kwargs(**args))


def run(core: EngineCore, requests) -> dict[str, list[int]]:
    for request in requests:
        core.add_request(request)
    tokens = {r.request_id: [] for r in requests}
    cached = {}
    for _ in range(10_000):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens
    run.cached = cached
    return tokens


PROMPTS = ([5, "image", 4], [3, "image", 6, "image", 2], [9])


def test_greedy_tokens_match_transformers_with_prefill_split_inside_images(llava):
    """A 13-token budget cuts every prompt's prefill inside its images; each image is
    encoded once all the same, and its features are gone once its positions are."""
    folder, hf = llava
    core = make_core(folder, max_num_batched_tokens=13, enable_prefix_caching=False)
    assert core.info.takes_images and core.info.num_image_tokens == NUM_IMAGE_TOKENS
    requests = [image_request(f"r{i}", pieces, seed=i) for i, pieces in enumerate(PROMPTS)]
    tokens = run(core, requests)
    for request in requests:
        assert tokens[request.request_id] == transformers_tokens(hf, request), request.request_id
    cache = core.executor.encoder_cache
    assert cache.num_encoded == 3  # one per image, however many chunks each took
    assert len(cache) == 0
    core.shutdown()


def test_encoder_budget_delays_an_image_to_the_next_step(llava):
    """A budget of one image: the two-image prompt's first step stops before its second
    image, which the next step encodes; tokens unchanged."""
    folder, hf = llava
    core = make_core(folder, max_num_encoder_input_tokens=NUM_IMAGE_TOKENS)
    request = image_request("two", PROMPTS[1], seed=1)
    core.add_request(request)
    sched = core.scheduler.schedule()
    assert sched.num_scheduled_tokens["two"] == request.mm_inputs[1].offset
    core.scheduler.step_failed(sched, "test: taken back")  # (undo: run it for real below)
    core.shutdown()
    core = make_core(folder, max_num_encoder_input_tokens=NUM_IMAGE_TOKENS)
    assert run(core, [request])["two"] == transformers_tokens(hf, request)
    core.shutdown()


def test_a_budget_under_one_image_is_refused(llava):
    folder, _ = llava
    with pytest.raises(ValueError, match="max_num_encoder_input_tokens"):
        make_core(folder, max_num_encoder_input_tokens=NUM_IMAGE_TOKENS - 1)


def test_prefix_cache_tells_images_apart(llava):
    """Same tokens, other image: no shared KV past the image; the same image: a hit."""
    folder, hf = llava
    core = make_core(folder)
    first = image_request("a", [20, "image:7", 12], seed=3)
    run(core, [first])
    other = image_request("b", [20, "image:8", 12], seed=3)
    assert other.prompt_token_ids == first.prompt_token_ids
    tokens = run(core, [other])
    # blocks of 8: [0, 16) are text only (shared); the image starts at 20
    assert run.cached["b"] == 16
    assert tokens["b"] == transformers_tokens(hf, other)
    same = image_request("c", [20, "image:7", 12], seed=3)
    tokens = run(core, [same])
    assert run.cached["c"] == 40  # every full block of the 48-token prompt but the last
    assert tokens["c"] == transformers_tokens(hf, same)
    core.shutdown()


def test_preemption_recomputes_images(llava):
    """A KV cache too small for all at once: requests are preempted and resumed (their
    images encoded again), and every greedy token is still transformers'."""
    folder, hf = llava
    core = make_core(folder, num_gpu_blocks_override=14, max_num_batched_tokens=24)
    requests = [
        image_request(f"p{i}", pieces, seed=10 + i, max_tokens=40)
        for i, pieces in enumerate([[5, "image", 4], [3, "image", 6], [2, "image", 9]])
    ]
    tokens = run(core, requests)
    assert core.scheduler.num_preemptions > 0
    for request in requests:
        assert tokens[request.request_id] == transformers_tokens(hf, request, 40)
    core.shutdown()


def test_n_children_and_prompt_logprobs_with_images(llava):
    """Prompt logprobs cover the image positions (the model's logits there); children of
    one prompt share its image."""
    folder, hf = llava
    core = make_core(folder)
    request = image_request("lp", [4, "image", 3], seed=5, prompt_logprobs=0, max_tokens=4)
    outs = []
    core.add_request(request)
    while core.has_unfinished_requests():
        outs += core.step()
    rows = [row for out in outs for row in (out.new_prompt_logprobs or [])]
    assert len(rows) == len(request.prompt_token_ids) - 1
    pixels = torch.from_numpy(request.mm_inputs[0].pixel_values[None])
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([request.prompt_token_ids]), pixel_values=pixels).logits
    expected = torch.log_softmax(logits[0, :-1].float(), -1)
    ids = request.prompt_token_ids[1:]
    got = torch.tensor([row.logprobs[0] for row in rows])
    want = expected[torch.arange(len(ids)), torch.tensor(ids)]
    assert (got - want).abs().max().item() < 1e-4
    core.shutdown()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r, m: (r[:-1], m), "not inside the prompt"),
        (lambda r, m: (r, (ImageInput(m[0].offset, 4, m[0].hash, m[0].pixel_values),)), "fills 4"),
        (lambda r, m: (r[:2] + [7] + r[3:], m), "must all hold the image token"),
        (lambda r, m: (r + [IMAGE_TOKEN], m), "without an image"),
        (
            lambda r, m: (r, (ImageInput.from_pixels(m[0].offset, 16, np.zeros((3, 8, 8))),)),
            "float32",
        ),
    ],
    ids=["outside", "length", "token", "stray", "pixels"],
)
def test_malformed_images_are_refused(llava, change, message):
    folder, _ = llava
    core = make_core(folder)
    good = image_request("x", [2, "image"], seed=1)
    ids, images = change(list(good.prompt_token_ids), good.mm_inputs)
    bad = EngineCoreRequest("x", ids, good.sampling_params, (), 0.0, mm_inputs=images)
    with pytest.raises(ValueError, match=message):
        core.add_request(bad)
    core.add_request(good)  # nothing of the refusal was kept
    core.shutdown()


def test_a_text_model_refuses_images(model_factory):
    core = EngineCore(EngineConfig.from_kwargs(model=str(model_factory()), dtype="float32"))
    pixels = np.zeros((3, 32, 32), np.float32)
    request = EngineCoreRequest(
        "t", [1, 2, 3], SamplingParams(), (), 0.0, mm_inputs=(ImageInput.from_pixels(0, 1, pixels),)
    )
    with pytest.raises(ValueError, match="does not take images"):
        core.add_request(request)
    core.shutdown()


def run_client(client, requests, timeout_s=120.0) -> dict[str, list[int]]:
    import time

    for request in requests:
        client.add_request(request)
    tokens = {r.request_id: [] for r in requests}
    left = {r.request_id for r in requests}
    deadline = time.monotonic() + timeout_s
    while left and time.monotonic() < deadline:
        batch = client.get_outputs(0.5)
        for out in batch.outputs if batch else ():
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                left.discard(out.request_id)
    assert not left, f"unfinished: {left}"
    return tokens


def test_images_cross_to_an_engine_process_through_a_tensor_slab(llava):
    """The pixel values go by reference (the client's slab; the ADD record carries refs),
    the tokens are the in-process engine's, and each request's tensors are freed when it
    ends or is aborted."""
    from ringllm.pipeline.engine.ring_client import RingCoreClient

    folder, hf = llava
    config = EngineConfig.from_kwargs(
        model=str(folder), dtype="float32", block_size=8, max_num_batched_tokens=13
    )
    client = RingCoreClient.start(config)
    try:
        assert client.info.takes_images and client.slab is not None
        requests = [image_request(f"q{i}", pieces, seed=i) for i, pieces in enumerate(PROMPTS)]
        tokens = run_client(client, requests)
        for request in requests:
            assert tokens[request.request_id] == transformers_tokens(hf, request)
        assert client.slab.num_free_slots == client.slab.layout.num_slots  # all freed
        aborted = image_request("gone", [3, "image"], seed=9, max_tokens=200)
        client.add_request(aborted)
        assert client.slab.num_free_slots == client.slab.layout.num_slots - 1
        client.abort_requests(["gone"])
        assert client.slab.num_free_slots == client.slab.layout.num_slots
        again = run_client(client, [image_request("after", [3, "image"], seed=9)])
        assert again["after"] == transformers_tokens(hf, image_request("x", [3, "image"], seed=9))
    finally:
        client.shutdown()


def test_tensor_parallel_ranks_encode_the_same_images(llava):
    """TP=2: each rank runs the (replicated) vision tower on the images the NEW records
    name; the tokens are the single-process engine's."""
    folder, hf = llava
    core = make_core(folder, tensor_parallel_size=2, max_num_batched_tokens=13)
    requests = [image_request(f"t{i}", pieces, seed=i) for i, pieces in enumerate(PROMPTS)]
    tokens = run(core, requests)
    for request in requests:
        assert tokens[request.request_id] == transformers_tokens(hf, request)
    core.shutdown()


def test_data_parallel_cores_take_images(llava):
    """DP=2: each core attaches the front end's slab of its own connection."""
    from ringllm.pipeline.engine.dp_client import DPCoreClient

    folder, hf = llava
    config = EngineConfig.from_kwargs(
        model=str(folder), dtype="float32", block_size=8, data_parallel_size=2
    )
    client = DPCoreClient.start(config)
    try:
        requests = [image_request(f"d{i}", pieces, seed=i) for i, pieces in enumerate(PROMPTS)]
        tokens = run_client(client, requests)
        for request in requests:
            assert tokens[request.request_id] == transformers_tokens(hf, request)
    finally:
        client.shutdown()


def test_kill_9_of_a_tp_engine_with_images_leaves_no_segment(llava):
    """The engine core owns the ranks' slab, the front end its own: after kill -9 of the
    core (mid-request) and the client's shutdown, /dev/shm holds neither."""
    import os
    import signal

    from ringllm.ipc.shm import list_segments
    from ringllm.pipeline.engine.ring_client import RingCoreClient
    from ringllm.pipeline.errors import EngineDeadError

    folder, _ = llava
    config = EngineConfig.from_kwargs(
        model=str(folder), dtype="float32", block_size=8, tensor_parallel_size=2
    )
    client = RingCoreClient.start(config)
    pid = client.engine_pid
    client.add_request(image_request("k", [3, "image", 2], seed=4, max_tokens=500))
    assert client.get_outputs(30.0) is not None  # it runs
    mine = [n for n in list_segments() if int(n.split("_")[1]) in (pid, os.getpid())]
    assert any("mm" in n for n in mine), mine  # both slabs exist
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError):
        for _ in range(100):
            client.get_outputs(0.2)
    client.shutdown()
    client.process.wait(5)
    left = [n for n in list_segments() if int(n.split("_")[1]) in (pid, os.getpid())]
    assert not left, left
