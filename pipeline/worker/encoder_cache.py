"""`EncoderCache`: the features of the images a step's tokens need, made once per image.

A multimodal model's prompt holds, for each image, `length` placeholder positions (the
image token); the model's input rows there are the image's features (its vision encoder,
then the projector), not the token's embedding. Chunked prefill may split those positions
over several steps, so an image is encoded when a step first computes one of its
positions and its features are kept here until the last of them is computed:

    step k:   chunk [..... |img 0 ......]          encode img 0, use rows 0..5
    step k+1: chunk [..... img 0| text |img 1 ..]  rows 6..15 from here; encode img 1
    after k+1: img 0 done -> dropped; img 1 kept

Rows are the InputBatch's: `drop(row)` when the request leaves the worker or resumes after
preemption (its KV was thrown away, so its images are computed again). The scheduler keeps
the same account (`Request.images_encoded`) for its encoder budget.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ringllm.pipeline.worker.input_batch import InputBatch, StepInputs


class EncoderCache:
    def __init__(self, timed: bool = False) -> None:
        self.timed = timed  # on a GPU: wait for the encoder to finish, to time it
        self._features: dict[int, dict[int, torch.Tensor]] = {}  # row -> image -> [L, H]
        self.num_encoded = 0  # images encoded since the start (tests, benchmarks)
        self.encode_s = 0.0  # seconds spent encoding them (host wall time, synchronized)

    def __len__(self) -> int:
        return sum(len(images) for images in self._features.values())

    def drop(self, row: int) -> None:
        self._features.pop(row, None)

    def inputs_embeds(
        self, model, batch: InputBatch, step: StepInputs, input_ids: torch.Tensor
    ) -> torch.Tensor | None:
        """The step's input rows [T, hidden] with every image position's feature row in
        place (images not cached yet encoded first, all in one batch); None when no
        scheduled token is an image position (the model embeds the ids itself)."""
        pieces = self._pieces(batch, step)
        if not pieces:
            return None
        self._encode(model, batch, [(row, i) for row, i, *_ in pieces])
        flat, rows = [], []
        for row, index, token_at, first, count in pieces:
            flat.append(np.arange(token_at, token_at + count))
            rows.append(self._features[row][index][first : first + count])
        embeds = model.embed_input_ids(input_ids)
        where = torch.from_numpy(np.concatenate(flat)).to(embeds.device)
        embeds[where] = torch.cat(rows).to(device=embeds.device, dtype=embeds.dtype)
        return embeds

    def release_computed(self, batch: InputBatch, step: StepInputs) -> None:
        """After a step: the features of images whose positions are now all computed go."""
        for b, row in enumerate(step.rows.tolist()):
            cached = self._features.get(row)
            if not cached:
                continue
            images = batch.mm_inputs[row]
            done = int(step.seq_lens[b])
            for index in [i for i in cached if images[i].end <= done]:
                del cached[index]
            if not cached:
                del self._features[row]

    def _pieces(self, batch: InputBatch, step: StepInputs) -> list[tuple[int, int, int, int, int]]:
        """(row, image, flat token index, first feature row, rows) of each image's
        positions among the step's tokens."""
        pieces = []
        query_start = step.query_start_loc
        for b, row in enumerate(step.rows.tolist()):
            images = batch.mm_inputs[row]
            if not images:
                continue
            end = int(step.seq_lens[b])
            start = end - int(query_start[b + 1] - query_start[b])
            for index, image in enumerate(images):
                lo, hi = max(start, image.offset), min(end, image.end)
                if lo < hi:
                    token_at = int(query_start[b]) + lo - start
                    pieces.append((row, index, token_at, lo - image.offset, hi - lo))
        return pieces

    def _encode(self, model, batch: InputBatch, needed: list[tuple[int, int]]) -> None:
        todo = []
        for row, index in needed:
            if index not in self._features.get(row, {}) and (row, index) not in todo:
                todo.append((row, index))
        if not todo:
            return
        started = time.perf_counter()
        pixels = np.stack([batch.mm_inputs[row][index].pixel_values for row, index in todo])
        features = model.embed_images(torch.from_numpy(pixels))
        if features.is_cuda and self.timed:
            torch.cuda.synchronize()
        self.encode_s += time.perf_counter() - started
        for (row, index), rows in zip(todo, features, strict=True):
            self._features.setdefault(row, {})[index] = rows
        self.num_encoded += len(todo)
