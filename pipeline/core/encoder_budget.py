"""The encoder budget: image feature positions the workers' vision encoder makes per step.

Each image's placeholder positions need its features, which the workers' vision encoder
makes once, when a step first computes one of its positions, and keeps until all of them
are computed (pipeline/worker/encoder_cache.py). Besides the token budget a step has this
budget (at least one whole image): a chunk that reaches an image not encoded yet that the
budget cannot take stops before it (`fit`). `Request.images_encoded` mirrors what the
workers hold; whoever makes the workers drop a request's features clears it.
"""

from __future__ import annotations

from ringllm.pipeline.core.request import Request


class EncoderBudget:
    def __init__(self, num_positions: int) -> None:
        self.num_positions = num_positions  # per step; 0: the model takes no images
        self.num_left = num_positions

    def begin_step(self) -> None:
        self.num_left = self.num_positions

    def fit(self, request: Request, start: int, num_new: int) -> tuple[int, list[int]]:
        """Cuts a chunk [start, start + num_new) before the first image it reaches that the
        workers have not encoded yet and that this step's budget cannot take; the tokens it
        keeps, and the images they make the workers encode (their cost is taken by `take`
        once the chunk is scheduled). An image is encoded whole once and its features kept
        until its positions are all computed, however the chunks split it."""
        images = []
        left = self.num_left
        for index in request.images_in(start, start + num_new):
            if index in request.images_encoded:
                continue
            image = request.mm_inputs[index]
            if image.length > left:
                return max(image.offset - start, 0), images
            images.append(index)
            left -= image.length
        return num_new, images

    def take(self, request: Request, images: list[int]) -> None:
        """The chunk `fit` cut is scheduled: its images are encoded this step."""
        for index in images:
            request.images_encoded.add(index)
            self.num_left -= request.mm_inputs[index].length
