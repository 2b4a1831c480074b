"""core/encoder_budget.py: a chunk stops before an image the step's encoder budget cannot
take; an image is paid for once, when first encoded."""

from __future__ import annotations

from ringllm.pipeline.core.encoder_budget import EncoderBudget
from ringllm.pipeline.core.request import Request
from ringllm.pipeline.messages import ImageInput
from ringllm.pipeline.sampling_params import SamplingParams


def request_with_images() -> Request:
    # positions [2, 6) and [8, 12) are the two images' placeholders
    images = (ImageInput(2, 4, b"a"), ImageInput(8, 4, b"b"))
    return Request("r", [3] * 14, SamplingParams(), mm_inputs=images)


def test_a_chunk_stops_before_the_first_image_the_budget_cannot_take():
    budget = EncoderBudget(6)
    request = request_with_images()
    assert budget.fit(request, 0, 14) == (8, [0])  # the second image would need 8 > 6
    budget.take(request, [0])
    assert budget.num_left == 2 and request.images_encoded == {0}
    assert budget.fit(request, 8, 6) == (0, [])  # nothing fits before image 1 this step
    budget.begin_step()
    assert budget.fit(request, 8, 6) == (6, [1])


def test_an_encoded_image_costs_nothing_again_and_a_chunk_inside_one_keeps_its_tokens():
    budget = EncoderBudget(4)
    request = request_with_images()
    request.images_encoded.add(0)
    assert budget.fit(request, 3, 11) == (11, [1])  # image 0 is held: only image 1 is paid
    assert budget.fit(request, 0, 2) == (2, [])  # no image in [0, 2)
    budget.num_left = 0
    assert budget.fit(request, 9, 5) == (0, [])  # inside image 1, not encoded: cut to 0
