"""The draft-model proposer (`speculative_config` method "draft_model").

A smaller model with the target's tokenizer runs in the same worker and drafts
`num_speculative_tokens` (k) tokens per request after each step. It keeps its own paged KV
cache, indexed by the target's block ids: the scheduler allocates a request's blocks once
for both models, plus k lookahead slots past its tokens where the drafts' keys and values go.

    target blocks   [ b7 ][ b2 ][ b9 ]            (batch.block_table[row])
    draft cache      key_cache[b7], key_cache[b2], key_cache[b9]   per draft layer

One `propose` call is k batched forward passes of the draft, for all rows together:

    pass 0      catch-up: each row from its first position without valid draft KV up to its
                last known token (the one sampled this step); one logits row per request
                -> draft d0.   Rows of one token (decodes) first, as ForwardBatch wants.
    pass j>0    one-token decodes: d(j-1) at position num_tokens + j - 1  -> draft dj

Invariant: after a call a request's draft KV is valid up to its `num_tokens` at that call.
The KV written for d0 .. d(k-2) sits past it and is recomputed by the next call, whatever
the verifier kept, so rejected drafts never leave stale keys behind. (The KV of accepted
drafts is right, and keeping it would make every catch-up one token; the simple rule pays
1 + accepted tokens per row in pass 0 instead, and needs no word from the verifier.)
A request that is new or resumed (`start`) recomputes from position 0. Blocks shared
through the prefix cache are rewritten with the same tokens at the same positions: the
same keys and values.

Sampling: a greedy row drafts the argmax; any other row draws from q = the row's
temperature / top-k / top-p / min-p distribution (penalties and logit_bias are not applied:
the rejection sampler is exact for any q as long as q is the distribution the draft was
really drawn from, which is what `Proposals.probs` returns). The Exp(1) draws come from the
row's own generator when it is seeded, else from this proposer's generator.
"""

from __future__ import annotations

import filecmp
import logging
from pathlib import Path

import numpy as np
import torch

from ringllm.pipeline.config import EngineConfig, ModelConfig
from ringllm.pipeline.models.forward_batch import ForwardBatch
from ringllm.pipeline.models.hf_config import DTYPE_NAMES, load_arch_config, torch_dtype
from ringllm.pipeline.ops.cpu import argmax_rows
from ringllm.pipeline.sample.sampler import Sampler, SamplingRequestState
from ringllm.pipeline.worker.model_loader import (
    LoadedModel,
    load_model,
    resolve_max_model_len,
    resolve_model_path,
)
from ringllm.pipeline.worker.model_runner import (
    allocate_kv_cache,
    kv_bytes_per_block,
    kv_cache_dtype,
)
from ringllm.pipeline.worker.spec_decode import Proposals

logger = logging.getLogger(__name__)

# NOTE: the shared generator must not replay the target sampler's stream (both would start
# from config.model.seed): a draft whose Exp(1) draws equal the verifier's uniforms would
# correlate the two and bias the rejection sampler. A fixed offset keeps it reproducible.
_DRAFT_SEED_OFFSET = 0x5DEECE66D


class DraftModelProposer:
    """`Proposer` (pipeline/worker/spec_decode.py) backed by a small causal LM."""

    def __init__(self, config: EngineConfig, runner) -> None:
        self.num_speculative_tokens = config.speculative.num_speculative_tokens
        self.num_lookahead_slots = self.num_speculative_tokens
        self.device = runner.device
        self.block_size = runner.block_size
        self.max_model_len = runner.max_model_len
        loaded = _load_draft(config, runner)
        self.model = loaded.model
        self.arch = loaded.arch
        self.model_path = loaded.path
        self.dtype = loaded.dtype
        # the draft's cache takes the engine's --kv-cache-dtype too (auto: the target's)
        self.kv_dtype = kv_cache_dtype(
            config.cache.kv_cache_dtype, self.dtype, self.device, runner.kv_dtype
        )
        self._kv_heads, self._head_dim = self.model.num_kv_heads, self.model.head_dim
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.sampler = Sampler(self.arch.vocab_size, seed=config.model.seed + _DRAFT_SEED_OFFSET)
        # request id -> tokens whose draft KV is valid (positions [0, n))
        self._num_valid_tokens: dict[str, int] = {}
        logger.info(
            "draft model %s: %d layers, %s, %d speculative tokens",
            self.model_path,
            self.arch.num_hidden_layers,
            str(self.dtype).removeprefix("torch."),
            self.num_speculative_tokens,
        )

    # ---- KV cache ------------------------------------------------------------------

    @property
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(
            self.arch.num_hidden_layers,
            self._kv_heads,
            self.block_size,
            self._head_dim,
            self.kv_dtype,
        )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_cache(
            self.arch.num_hidden_layers,
            (num_blocks, self._kv_heads, self.block_size, self._head_dim),
            self.kv_dtype,
            self.device,
        )
        # whatever was cached is gone (sleep, re-allocation): every request starts over
        self._num_valid_tokens.clear()

    def release_kv_cache(self) -> None:
        self.kv_caches = []
        self._num_valid_tokens.clear()

    # ---- requests ------------------------------------------------------------------

    def start(self, request_id: str) -> None:
        self._num_valid_tokens[request_id] = 0

    def finish(self, request_id: str) -> None:
        self._num_valid_tokens.pop(request_id, None)

    # ---- drafting ------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, batch, rows: np.ndarray, request_ids: list[str]) -> Proposals:
        """Up to k drafts per row (fewer only where they would pass max_model_len), with
        q for every row that does not decode greedily."""
        if not self.kv_caches:
            raise RuntimeError("the draft model's KV cache is not allocated (initialize_kv_cache)")
        rows = np.asarray(rows, np.int64)
        num_tokens = batch.num_tokens[rows].astype(np.int64)
        # the verifier computes positions num_tokens - 1 .. num_tokens + drafts - 1
        num_drafts = np.clip(self.max_model_len - num_tokens, 0, self.num_speculative_tokens)
        valid = np.fromiter(
            (self._num_valid_tokens.get(rid, 0) for rid in request_ids), np.int64, len(rows)
        )
        # at least the last token is fed again: its logits give d0
        starts = np.minimum(valid, num_tokens - 1)
        drafting = np.flatnonzero(num_drafts > 0)
        # pass 0's order: one-token catch-ups (decodes) first, else as asked
        drafting = drafting[np.argsort(num_tokens[drafting] - starts[drafting] != 1, kind="stable")]
        states = [batch.sampling[row] for row in rows.tolist()]
        token_ids = [np.zeros(0, np.int32) for _ in rows]
        probs: list[torch.Tensor | None] = [None] * len(rows)
        for i in np.flatnonzero(num_drafts == 0).tolist():
            if not states[i].params.is_greedy:
                probs[i] = self._no_probs()
        if drafting.size:
            run = _DraftRun([states[i] for i in drafting.tolist()])
            picked = rows[drafting], starts[drafting], num_tokens[drafting]
            drafts, q = self._draft(batch, run, *picked, num_drafts[drafting])
            for d, i in enumerate(drafting.tolist()):
                token_ids[i] = drafts[d, : num_drafts[i]]
                if q is not None and run.q_slot[d] >= 0:
                    probs[i] = q[run.q_slot[d], : num_drafts[i]]
                self._num_valid_tokens[request_ids[i]] = int(num_tokens[i])
        return Proposals(token_ids=token_ids, probs=probs)

    def _draft(self, batch, run, rows, starts, num_tokens, num_drafts):
        """The k passes over the drafting rows (pass-0 order): int32 drafts [R, k] (host)
        and q [random rows, k, vocab] (device, or None when every row is greedy)."""
        k, vocab = self.num_speculative_tokens, self.arch.vocab_size
        drafts = torch.empty((len(rows), k), dtype=torch.int64, device=self.device)
        q = None
        if run.num_random:
            q = torch.empty((run.num_random, k, vocab), dtype=torch.float32, device=self.device)
        inputs = self._batch_of(batch, rows, starts, num_tokens - starts)
        drafts[:, 0] = self._sample(self._logits(inputs), run, np.arange(len(rows)), 0, q)
        for j in range(1, k):
            active = np.flatnonzero(num_drafts > j)
            if active.size == 0:
                break
            # d(j-1) at position num_tokens + j - 1, fed straight from the device
            index = slice(None)
            if active.size < len(rows):
                index = torch.from_numpy(active).to(self.device)
            position = num_tokens[active] + j - 1
            inputs = self._batch_of(
                batch, rows[active], position, np.ones_like(position), drafts[index, j - 1]
            )
            drafts[index, j] = self._sample(self._logits(inputs), run, active, j, q)
        return drafts.cpu().numpy().astype(np.int32), q

    def _batch_of(self, batch, rows, starts, query_lens, input_ids=None) -> ForwardBatch:
        """The flat ForwardBatch of rows computing positions [start, start + query_len)
        each (one-token rows first); their tokens are the rows' known ones unless given."""
        num_reqs = len(rows)
        query_start_loc = np.zeros(num_reqs + 1, np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        seq_lens = starts + query_lens
        positions = _positions(starts, seq_lens)
        token_rows = np.repeat(rows, query_lens)
        bs = self.block_size
        block_index = positions // bs
        if np.any(block_index >= batch.num_blocks[token_rows]):
            raise RuntimeError(
                "draft model: a position has no KV block in its request's block table "
                f"(block_size {bs}); the scheduler must reserve num_lookahead_slots = "
                f"{self.num_lookahead_slots} slots past each speculating request's tokens"
            )
        block_tables = batch.block_table[rows, : int(-(-seq_lens.max() // bs))]
        slot_mapping = batch.block_table[token_rows, block_index].astype(np.int64) * bs
        slot_mapping += positions % bs
        if input_ids is None:
            input_ids = self._to_device(batch.token_ids[token_rows, positions].astype(np.int64))
        put = self._to_device
        return ForwardBatch(
            input_ids=input_ids,
            positions=put(positions),
            slot_mapping=put(slot_mapping),
            query_start_loc=put(query_start_loc.astype(np.int32)),
            seq_lens=put(seq_lens.astype(np.int32)),
            block_tables=put(block_tables),
            num_decodes=int(np.count_nonzero(query_lens == 1)),
            logits_indices=put(query_start_loc[1:] - 1),
        )

    def _logits(self, inputs: ForwardBatch) -> torch.Tensor:
        hidden = self.model.forward(inputs, self.kv_caches)
        return self.model.compute_logits(hidden[inputs.logits_indices])

    def _sample(self, logits, run: _DraftRun, active: np.ndarray, j: int, q) -> torch.Tensor:
        """One draft per active row: the argmax for greedy rows, argmax(q / E) otherwise
        (q stored at [q_slot, j])."""
        slots = run.q_slot[active]
        random_local = np.flatnonzero(slots >= 0)
        if random_local.size == 0:
            return argmax_rows(logits)
        whole = random_local.size == len(active)
        index = None if whole else torch.from_numpy(random_local).to(logits.device)
        members = active[random_local].tolist()
        row_q = self.sampler.filtered_probs(
            logits if whole else logits[index], [run.states[m].params for m in members]
        )
        q[torch.from_numpy(slots[random_local]).to(logits.device), j] = row_q
        draws = self.sampler.draw_exponentials(row_q, [run.states[m].generator for m in members])
        picked = row_q.div_(draws).argmax(dim=-1)
        if whole:
            return picked
        tokens = argmax_rows(logits)
        tokens[index] = picked
        return tokens

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(array))
        return host if self.device == "cpu" else host.to(self.device)

    def _no_probs(self) -> torch.Tensor:
        return torch.empty((0, self.arch.vocab_size), dtype=torch.float32, device=self.device)


class _DraftRun:
    """The sampling side of one propose call, per drafting row (pass-0 order)."""

    def __init__(self, states: list[SamplingRequestState]) -> None:
        self.states = states
        greedy = np.fromiter((s.params.is_greedy for s in states), bool, len(states))
        # row -> its index among the random rows (its q), -1 for a greedy row
        self.q_slot = np.full(len(states), -1, np.int64)
        self.q_slot[~greedy] = np.arange(int(np.count_nonzero(~greedy)))
        self.num_random = int(np.count_nonzero(~greedy))


def _positions(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """[start, end) of every request, concatenated."""
    lengths = ends - starts
    first = np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return first + np.arange(int(lengths.sum()))


# ---- loading -------------------------------------------------------------------------


def _load_draft(config: EngineConfig, runner) -> LoadedModel:
    """The draft model, at the target's dtype and max_model_len, or a ValueError naming
    speculative_config.model and what does not match the target."""
    spec_model = config.speculative.get("model")
    where = f"speculative_config.model: {spec_model}"
    try:
        path = resolve_model_path(spec_model)
        arch = load_arch_config(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where} does not load as a draft model ({exc})") from None
    target = runner.arch
    if arch.vocab_size != target.vocab_size:
        raise ValueError(
            f"{where}: the draft's vocab_size is {arch.vocab_size} tokens, the target's "
            f"{target.vocab_size}; a draft model must share the target's vocabulary"
        )
    try:
        resolve_max_model_len(runner.max_model_len, arch)
    except ValueError as exc:
        raise ValueError(
            f"{where}: the draft cannot run at the target's max_model_len of "
            f"{runner.max_model_len} tokens ({exc}); lower max_model_len or choose a draft "
            f"with a longer context"
        ) from None
    target_tokenizer = Path(config.model.tokenizer or runner.model_path) / "tokenizer.json"
    draft_tokenizer = path / "tokenizer.json"
    if (
        target_tokenizer.is_file()
        and draft_tokenizer.is_file()
        and not filecmp.cmp(target_tokenizer, draft_tokenizer, shallow=False)
    ):
        raise ValueError(
            f"{where}: its tokenizer.json differs from the target's ({target_tokenizer}); "
            f"a draft model must use the same tokenizer"
        )
    draft_config = ModelConfig(
        model=str(path),
        dtype=next(name for name in DTYPE_NAMES if torch_dtype(name) == runner.dtype),
        max_model_len=runner.max_model_len,
        seed=config.model.seed,
        load_format=config.model.load_format,
    )
    try:
        return load_model(draft_config, runner.device, runner.ops)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{where} does not load as a draft model ({exc})") from None
