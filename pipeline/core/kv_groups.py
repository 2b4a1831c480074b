"""`KVGroups`: which layers share a block table, and which KV tensors they write (vLLM's
hybrid KV cache).

A sliding-window layer's queries see their last W keys only, so the blocks that fell out
of its window can go back to the pool while the sequence grows; a global layer keeps
every block. Layers are put in groups of one kind and of the same size, every group with
a block table of its own, all of them drawing from one block pool:

    Gemma 3 270M: 18 layers, window 512, every 6th global
        layers   0  1  2  3  4  5 | 6  7 ... 11 | 12 ... 17
        kind     s  s  s  s  s  g | s  s ... g  | s  ...  g
        groups   g0 = {0, 1, 2}  g1 = {3, 4, 6}  g2 = {7, 8, 9}  g3 = {10, 12, 13}
                 g4 = {14, 15, 16}               g5 = {5, 11, 17}   (the global one)
        slots    a group's i-th layer writes KV tensor i: 3 tensors of [num_blocks, ...]

A block id then names one block of one group: 3 layers' keys and values, not 18, and a
sequence of 8,192 tokens holds 512 blocks in the global group and about 33 in each
sliding one (677 against 3,072 for the same bytes kept by every layer: 4.5x).

The core and every worker compute the same groups from the model's layer windows
(`WorkerInfo.layer_windows`) and the config (`kv_groups`), so no table travels between
them. A request's table interleaves its groups: logical block i of group g sits in
column i * G + g, so the block ids of a step still travel as one list per request and a
worker's copy of a row grows as it always did (`InputBatch`); each group's table is the
columns g::G of it. A sliding group's blocks before its window are the null block (id 0,
never handed out) once freed (the worker's copy keeps their old ids): no key before a
query's window counts (the C and CUDA kernels skip those blocks, the torch reference
reads and masks them; a stale id is still a block of the cache).

Group size: the fewest layers of one kind; a kind with more layers is cut into several
groups of that size (the last one padded with unused slots, as vLLM does).
"""

from __future__ import annotations

from dataclasses import dataclass

NULL_BLOCK = 0  # a freed sliding block's column; never allocated while groups slide


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int, ...]  # per group: its layers' sliding window (0: global)
    group_of_layer: tuple[int, ...]  # per layer of the whole model
    slot_of_layer: tuple[int, ...]  # the KV tensor the layer writes
    num_slots: int  # KV tensors, each [num_blocks, kv_heads, block_size, head_dim]

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def slides(self) -> bool:
        """Whether a group frees blocks that fell out of its window."""
        return any(self.windows)

    def describe(self) -> str:
        if not self.slides:
            return f"every layer keeps every block ({self.num_slots} layers per block)"
        kinds = ", ".join(
            f"{sum(1 for w in self.windows if w == window)} x "
            + (f"window {window}" if window else "global")
            for window in sorted(set(self.windows), reverse=True)
        )
        return f"{self.num_groups} groups of {self.num_slots} layers ({kinds})"

    def peak_blocks(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Blocks one sequence of `num_tokens` holds at most, prefilled in chunks of up to
        `chunk` tokens (a sliding group holds its window and the chunk it computes)."""
        blocks = -(-num_tokens // block_size)
        total = 0
        for window in self.windows:
            if window:
                total += min(blocks, -(-(window - 1 + chunk) // block_size) + 1)
            else:
                total += blocks
        return total


def single_group(num_layers: int) -> KVGroups:
    """Every layer in one group that keeps every block (the layout without windows)."""
    return KVGroups((0,), (0,) * num_layers, tuple(range(num_layers)), num_layers)


def kv_groups(layer_windows, enabled: bool = True) -> KVGroups:
    """The groups of a model whose layers have these sliding windows (0: global);
    `enabled` False: one group keeping every block (`single_group`)."""
    windows = [int(w) for w in layer_windows]
    if any(w < 0 for w in windows):
        raise ValueError(f"layer windows: {windows} has a negative window")
    if not windows:
        raise ValueError("layer windows: a model without layers")
    if not enabled or not any(windows):
        return single_group(len(windows))
    kinds = sorted(set(windows))
    layers_of = {kind: [i for i, w in enumerate(windows) if w == kind] for kind in kinds}
    size = min(len(layers) for layers in layers_of.values())
    group_windows, group_of, slot_of = [], [0] * len(windows), [0] * len(windows)
    # sliding groups first, the global ones last, each kind in layer order
    for kind in sorted(kinds, key=lambda w: (w == 0, w)):
        layers = layers_of[kind]
        for start in range(0, len(layers), size):
            group = len(group_windows)
            group_windows.append(kind)
            for slot, layer in enumerate(layers[start : start + size]):
                group_of[layer], slot_of[layer] = group, slot
    return KVGroups(tuple(group_windows), tuple(group_of), tuple(slot_of), size)


def hybrid_off_reason(config) -> str | None:
    """Why an engine with this config keeps every layer's blocks (None: its sliding
    layers may free theirs)."""
    if config.cache.disable_hybrid_kv_cache_manager:
        return "--disable-hybrid-kv-cache-manager"
    if config.speculative.enabled and config.speculative.method != "ngram":
        return "a draft model (its KV cache follows the target's one block table)"
    return None


def engine_kv_groups(layer_windows, config) -> KVGroups:
    """The groups both the engine core and its workers use."""
    return kv_groups(layer_windows, enabled=hybrid_off_reason(config) is None)
