"""Pipeline stages (models/stages.py and the decoders' `stage`): the layer split, and a model
cut into stages computing what the whole model does.

The oracle is the whole model: 2 and 3 stages (even and uneven splits) are chained by hand,
each with its own KV cache over the same block ids, over mixed steps (prefill chunks cut at
odd points next to decodes); every logit row must be the whole model's, bit for bit (the
stages run the very same operations on the very same tensors). Each stage reads only its
own tensors from the safetensors files, and hands on 2 x T x H x dtype bytes per step.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import pytest
import torch

from ringllm.pipeline.config import ModelConfig
from ringllm.pipeline.executor.process_groups import GlooCommunicator, Rendezvous
from ringllm.pipeline.models.forward_batch import ForwardBatch
from ringllm.pipeline.models.hf_config import load_arch_config
from ringllm.pipeline.models.linear import layout
from ringllm.pipeline.models.registry import model_class
from ringllm.pipeline.models.stages import (
    IntermediateTensors,
    StageInfo,
    layer_partition,
    pipeline_stages,
)
from ringllm.pipeline.models.weights import WeightSource
from ringllm.pipeline.ops import get_ops
from ringllm.pipeline.worker.model_loader import load_model, model_stages
from ringllm.pipeline.worker.model_runner import allocate_kv_cache
from ringllm.pipeline.worker.sleep import OffloadedWeights, weight_slots
from ringllm.tools.make_model import ModelShape, make_model

BLOCK_SIZE = 8
NUM_BLOCKS = 32
PROMPT_LENS = (5, 17, 40)
# Chunk ends per prompt: step k computes prompt[cuts[k-1]:cuts[k]]; a prompt done decodes.
CHUNK_CUTS = ((3, 5), (17,), (7, 23, 40))
NUM_DECODES = 4  # decode steps of each request once its prompt is in
# Blocks handed out out of order, so a wrong block-table lookup cannot pass by accident.
BLOCKS = ([9, 2, 30, 4, 17, 6], [1, 22, 8, 14, 11], [3, 27, 5, 19, 12, 25, 7, 21])
NUM_LAYERS = 4
PACKED_SHAPE = {"hidden_size": 384, "intermediate_size": 768}  # as tests/.../test_models.py
SPLITS = [(2, None), (2, "1,3"), (2, "3,1"), (3, None), (3, "2,1,1")]  # None: even


# ---- layer_partition --------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_layers, pp_size, want",
    [  # vLLM's own cases (tests/distributed/test_pipeline_partition.py) and a few more
        (2, 2, [(0, 1), (1, 2)]),
        (3, 2, [(0, 2), (2, 3)]),
        (3, 3, [(0, 1), (1, 2), (2, 3)]),
        (4, 3, [(0, 1), (1, 3), (3, 4)]),
        (5, 3, [(0, 2), (2, 4), (4, 5)]),
        (22, 4, [(0, 5), (5, 11), (11, 17), (17, 22)]),  # 5, 6, 6, 5
        (7, 4, [(0, 2), (2, 4), (4, 6), (6, 7)]),  # every stage but the last gets one
        (32, 1, [(0, 32)]),
    ],
)
def test_even_split_is_vllms(num_layers, pp_size, want):
    assert layer_partition(num_layers, pp_size) == want


@pytest.mark.parametrize(
    "partition, num_layers, want",
    [
        ("5,5,5,5", 20, [(0, 5), (5, 10), (10, 15), (15, 20)]),
        ("4,6,6,4", 20, [(0, 4), (4, 10), (10, 16), (16, 20)]),
        ("5,6,5,6", 22, [(0, 5), (5, 11), (11, 16), (16, 22)]),
        (" 1, 3", 4, [(0, 1), (1, 4)]),
    ],
)
def test_explicit_split(partition, num_layers, want):
    assert layer_partition(num_layers, len(want), partition) == want


@pytest.mark.parametrize(
    "num_layers, pp_size, partition, message",
    [
        (4, 0, None, r"pipeline_parallel_size: must be >= 1 stage, got 0"),
        (4, -2, "2,2", r"pipeline_parallel_size: must be >= 1 stage, got -2"),
        (4, 5, None, r"5 stages is more than the model's 4 layers"),
        (4, 5, "1,1,1,1,0", r"5 stages is more than the model's 4 layers"),
        (20, 4, "5,5,5,5,", r"not a comma-separated list of layer counts"),
        (20, 4, "5,5,5,a", r"not a comma-separated list of layer counts"),
        (4, 2, "2.5,1.5", r"not a comma-separated list of layer counts"),
        (4, 2, "", r"not a comma-separated list of layer counts"),
        (20, 4, "5,5,10", r"3 entries for pipeline_parallel_size 4"),
        (21, 4, "5,5,5,5", r"adds up to 20 layers, the model has 21"),
        (4, 2, "0,4", r"stage 0 gets 0 layers; each needs >= 1"),
        (4, 2, "5,-1", r"stage 1 gets -1 layers; each needs >= 1"),
        (0, 1, None, r"the model has 0 layers"),
    ],
)
def test_bad_splits_are_refused(num_layers, pp_size, partition, message):
    with pytest.raises(ValueError, match=message):
        layer_partition(num_layers, pp_size, partition)


def test_stage_info():
    first, middle, last = pipeline_stages(4, 3)
    assert (first.is_first, first.is_last, first.num_layers) == (True, False, 1)
    assert not (middle.is_first or middle.is_last) and middle == StageInfo(1, 3, 1, 3)
    assert (last.is_first, last.is_last, last.rank, last.size) == (False, True, 2, 3)
    whole = StageInfo.whole(4)
    assert whole.is_first and whole.is_last and whole == StageInfo(0, 1, 0, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.rank = 1
    with pytest.raises(ValueError, match=r"rank 3 is not in \[0, 3\)"):
        StageInfo(3, 3, 0, 1)
    with pytest.raises(ValueError, match=r"layers \[2, 2\) hold no layer"):
        StageInfo(0, 2, 2, 2)


def test_model_stages_from_config_json(model_factory):
    config = ModelConfig(model=str(model_factory("llama", num_layers=NUM_LAYERS)))
    assert model_stages(config, 3) == pipeline_stages(4, 3)  # the config's 4 layers
    with pytest.raises(ValueError, match=r"5 stages is more than the model's 4 layers"):
        model_stages(config, 5)
    with pytest.raises(ValueError, match=r"adds up to 3 layers, the model has 4"):
        model_stages(config, 2, "1,2")


# ---- running stages -----------------------------------------------------------------------


def mixed_steps(vocab_size: int, seed: int = 0) -> list[ForwardBatch]:
    """The steps of three requests: prefill chunks (CHUNK_CUTS), then NUM_DECODES decodes
    each; a request that has its prompt in decodes next to the others' chunks. Token ids
    are drawn in advance (no sampling: the logits are compared, not the tokens)."""
    g = torch.Generator().manual_seed(seed)
    seqs = [
        torch.randint(0, vocab_size, (n + NUM_DECODES,), generator=g).tolist() for n in PROMPT_LENS
    ]
    done, steps = [0] * len(seqs), []
    for step in range(max(len(c) for c in CHUNK_CUTS) + NUM_DECODES):
        decodes, prefills = [], []
        for i, seq in enumerate(seqs):
            if done[i] == len(seq):
                continue
            prefilling = step < len(CHUNK_CUTS[i])
            end = CHUNK_CUTS[i][step] if prefilling else done[i] + 1
            (prefills if prefilling else decodes).append((seq[done[i] : end], done[i], BLOCKS[i]))
            done[i] = end
        steps.append(forward_batch(decodes + prefills))
    assert done == [len(s) for s in seqs]
    assert any(0 < b.num_decodes < b.num_reqs for b in steps)  # decodes beside chunks
    return steps


def forward_batch(chunks) -> ForwardBatch:
    """chunks: (token_ids, num_computed, block_ids) per request, one-token decodes first;
    logits wanted for every row."""
    ids, positions, slots, starts, seq_lens = [], [], [], [0], []
    for tokens, done, blocks in chunks:
        for pos in range(done, done + len(tokens)):
            positions.append(pos)
            slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        ids += tokens
        starts.append(len(ids))
        seq_lens.append(done + len(tokens))
    width = max(len(b) for _, _, b in chunks)
    num_decodes = 0
    while num_decodes < len(chunks) and len(chunks[num_decodes][0]) == 1:
        num_decodes += 1
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([list(b) + [0] * (width - len(b)) for _, _, b in chunks]),
        num_decodes=num_decodes,
        logits_indices=torch.arange(len(ids), dtype=torch.int64),
    )


def load(path, stage=None, dtype="float32", comm=None):
    config = ModelConfig(model=str(path), dtype=dtype)
    return load_model(config, "cpu", get_ops("cpu"), comm=comm, stage=stage).model


def run_stage(model, steps, inputs=None, inputs_embeds=None) -> list:
    """One stage over every step, with its own KV cache (one pair per local layer):
    `inputs` the previous stage's IntermediateTensors per step (None on the first stage).
    Returns per step its IntermediateTensors, or (the last stage) float32 logits."""
    shape = (NUM_BLOCKS, model.num_kv_heads, BLOCK_SIZE, model.head_dim)
    kv = allocate_kv_cache(model.num_local_layers, shape, model.dtype, "cpu")
    assert len(model.layers) == model.num_local_layers == len(kv)
    outputs = []
    with torch.inference_mode():
        for k, batch in enumerate(steps):
            embeds = inputs_embeds[k] if inputs_embeds else None
            out = model.forward(batch, kv, embeds, intermediate=inputs[k] if inputs else None)
            if model.stage.is_last:
                out = model.compute_logits(out[batch.logits_indices])
            outputs.append(out)
    return outputs


def run_chain(models, steps, inputs_embeds=None) -> tuple[list[torch.Tensor], list[int]]:
    """The stages in order over every step; returns the logits per step and the bytes
    handed between stages per step."""
    outputs, handed = None, [0] * len(steps)
    for model in models:
        outputs = run_stage(model, steps, outputs, inputs_embeds if model.stage.is_first else None)
        if not model.stage.is_last:
            for k, (batch, x) in enumerate(zip(steps, outputs, strict=True)):
                assert isinstance(x, IntermediateTensors)
                hidden_size = model.arch.hidden_size
                assert x.hidden.shape == x.residual.shape == (batch.num_tokens, hidden_size)
                assert x.hidden.dtype == x.residual.dtype == model.dtype
                handed[k] += x.nbytes
    return outputs, handed


@pytest.fixture(scope="module")
def whole_runs(model_factory):
    """name -> (model folder, steps, the whole model's logits per step), made once."""
    runs = {}

    def run(name: str):
        if name not in runs:
            path = model_factory(name, num_layers=NUM_LAYERS)
            model = load(path)
            steps = mixed_steps(model.arch.vocab_size)
            runs[name] = path, steps, run_stage(model, steps)
        return runs[name]

    return run


@pytest.mark.parametrize("pp_size, partition", SPLITS)
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "gemma3"])
def test_chained_stages_give_the_whole_models_logits(whole_runs, name, pp_size, partition):
    path, steps, want = whole_runs(name)
    stages = pipeline_stages(NUM_LAYERS, pp_size, partition)
    models = [load(path, stage) for stage in stages]
    assert [len(m.layers) for m in models] == [s.num_layers for s in stages]
    assert [m.embed is not None for m in models] == [s.is_first for s in stages]
    assert [m.lm_head is not None for m in models] == [s.is_last for s in stages]
    got, handed = run_chain(models, steps)
    hidden_size = models[0].arch.hidden_size
    for k, (batch, ours, theirs) in enumerate(zip(steps, got, want, strict=True)):
        assert ours.dtype == torch.float32 and ours.shape == theirs.shape
        diff = (ours - theirs).abs().max().item()
        assert diff <= 1e-5, f"{name} {partition or 'even'}/{pp_size} step {k}: max diff {diff}"
        assert torch.equal(ours, theirs), f"{name} step {k}: not bit-identical"
        assert handed[k] == (pp_size - 1) * 2 * batch.num_tokens * hidden_size * 4


@pytest.mark.parametrize("checkpoint, dtype", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_other_dtypes_and_weight_layouts(model_factory, checkpoint, dtype):
    """bf16 activations are handed on in bf16; a bf16 checkpoint computed in float32 has
    matrices in a packed layout (models/linear.py: big enough for one), on every stage."""
    path = model_factory("llama", num_layers=NUM_LAYERS, dtype=checkpoint, **PACKED_SHAPE)
    whole = load(path, dtype=dtype)
    steps = mixed_steps(whole.arch.vocab_size, seed=1)
    want = run_stage(whole, steps)
    models = [load(path, s, dtype=dtype) for s in pipeline_stages(NUM_LAYERS, 2, "1,3")]
    kinds = {layout(m.layers[0].qkv) for m in [whole, *models]}
    assert len(kinds) == 1 and (dtype == "bfloat16" or kinds != {"plain"})
    got, handed = run_chain(models, steps)  # checks the hand-over dtype is the model's
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    itemsize = torch.finfo(whole.dtype).bits // 8
    assert handed[0] == 2 * steps[0].num_tokens * whole.arch.hidden_size * itemsize


# ---- what a stage reads -------------------------------------------------------------------


class RecordingSource(WeightSource):
    """A WeightSource that records the name of every tensor read."""

    def __init__(self, folder) -> None:
        super().__init__(folder)
        self.read: list[str] = []

    def get(self, name, shard=None, shape=None):
        self.read.append(name)
        return super().get(name, shard=shard, shape=shape)


def reads_of(path, stage) -> list[str]:
    arch = load_arch_config(path)
    cls = model_class(arch.architecture)
    model = cls(cls.adapt_config(arch), get_ops("cpu"), torch.float32, "cpu", 64, stage=stage)
    source = RecordingSource(path)
    model.load_weights(source)
    return source.read


@pytest.mark.parametrize("name", ["llama", "mistral"])  # a tied head; 3 files, its own head
def test_a_stage_reads_only_its_tensors(model_factory, name):
    path = model_factory(name, num_layers=NUM_LAYERS)
    names = WeightSource(path).names()
    tied = "lm_head.weight" not in names
    assert tied == (name == "llama")
    whole = reads_of(path, None)
    assert sorted(whole) == names  # the whole model reads every tensor once
    together = []
    for stage in pipeline_stages(NUM_LAYERS, 3, "1,2,1"):
        read = reads_of(path, stage)
        counts = collections.Counter(read)
        want = {
            n
            for n in names
            for i in range(stage.start_layer, stage.end_layer)
            if n.startswith(f"model.layers.{i}.")
        }
        if stage.is_first:
            want.add("model.embed_tokens.weight")
        if stage.is_last:
            want |= {"model.norm.weight", "model.embed_tokens.weight" if tied else "lm_head.weight"}
        assert set(read) == want, f"stage {stage.rank}"
        assert max(counts.values()) == 1, f"stage {stage.rank} read a tensor twice: {counts}"
        together += read
    # every tensor is read by one stage, a tied embedding by the first and the last
    extra = ["model.embed_tokens.weight"] if tied else []
    assert sorted(together) == sorted(names + extra)


# ---- refusals ------------------------------------------------------------------------------


def test_a_stage_refuses_what_is_not_its_part(model_factory):
    path = model_factory("llama", num_layers=NUM_LAYERS)
    first, last = (load(path, s) for s in pipeline_stages(NUM_LAYERS, 2))
    batch = mixed_steps(first.arch.vocab_size)[0]
    shape = (NUM_BLOCKS, first.num_kv_heads, BLOCK_SIZE, first.head_dim)
    kv = allocate_kv_cache(2, shape, torch.float32, "cpu")
    with torch.inference_mode():
        handed = first.forward(batch, kv)
        with pytest.raises(ValueError, match=r"stage 1 of 2 takes the previous stage's"):
            last.forward(batch, kv)
        with pytest.raises(ValueError, match=r"first pipeline stage embeds its input ids"):
            first.forward(batch, kv, intermediate=handed)
        with pytest.raises(ValueError, match=r"stage 0 of 2 holds no LM head"):
            first.compute_logits(handed.hidden)
        with pytest.raises(ValueError, match=r"3 caches for the 2 layers of pipeline stage 1"):
            last.forward(batch, kv + kv[:1], intermediate=handed)
    with pytest.raises(ValueError, match=r"stage 1 of 2 holds no embedding"):
        last._embed(batch.input_ids)
    for stage in (StageInfo(1, 2, 2, 5), StageInfo(0, 2, 1, 2), StageInfo(1, 2, 2, 3)):
        with pytest.raises(ValueError, match=r"do not fit the model's 4 layers"):
            load(path, stage)


# ---- with tensor parallelism, sleep mode, images ------------------------------------------


def run_tp_group(path, stage, steps, inputs=None) -> list[list]:
    """Two tensor-parallel ranks of one stage (a gloo group, a thread each) over every
    step; rank r takes inputs[r] (the previous stage's rank r)."""
    rendezvous = Rendezvous.create("cpu")
    results: list = [None, None]

    def rank_main(rank: int) -> None:
        comm = GlooCommunicator(rank, 2, rendezvous.address)
        try:
            model = load(path, stage, comm=comm)
            results[rank] = run_stage(model, steps, inputs[rank] if inputs else None)
        finally:
            comm.close()

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    rendezvous.close()
    assert results[0] is not None and results[1] is not None, "a rank failed (see its traceback)"
    return results


def test_pp2_tp2_gives_tp2s_logits(whole_runs):
    """Each stage a TP=2 group; rank r of stage 0 hands on to rank r of stage 1 (both
    ranks of a stage hold the same, all-reduced, hidden states and residual)."""
    path, steps, tp1 = whole_runs("llama")
    whole_tp2 = run_tp_group(path, None, steps)[0]
    first, last = pipeline_stages(NUM_LAYERS, 2, "1,3")
    handed = run_tp_group(path, first, steps)
    for a, b in zip(*handed, strict=True):
        assert torch.equal(a.hidden, b.hidden) and torch.equal(a.residual, b.residual)
    got = run_tp_group(path, last, steps, handed)
    for ours0, ours1, want, ref in zip(*got, whole_tp2, tp1, strict=True):
        assert torch.equal(ours0, ours1)
        assert torch.equal(ours0, want)  # the same sums in the same order as TP=2 whole
        torch.testing.assert_close(ours0, ref, atol=1e-4, rtol=0)


def test_phi3_tp2_splits_its_fused_tensors(whole_runs):
    """Phi-3's qkv_proj and gate_up_proj are fused in the file: each rank cuts its q, k, v
    (q and k permuted for the partial rotary) and gate, up from their own parts."""
    path, steps, tp1 = whole_runs("phi3")
    for ours0, ours1, ref in zip(*run_tp_group(path, None, steps), tp1, strict=True):
        assert torch.equal(ours0, ours1)
        torch.testing.assert_close(ours0, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_moe_experts_shard_over_tp2_and_stages_over_pp2(whole_runs, name):
    """TP=2: each rank holds a slice of every expert (gate / up rows, down columns) and the
    whole router; the experts' sum is reduced after the MLP. PP=2: each stage reads its own
    layers' experts, bit for bit the whole model. Sleep level 1 takes every expert out and
    puts it back."""
    path, steps, tp1 = whole_runs(name)
    for ours0, ours1, ref in zip(*run_tp_group(path, None, steps), tp1, strict=True):
        assert torch.equal(ours0, ours1)
        torch.testing.assert_close(ours0, ref, atol=1e-4, rtol=0)
    models = [load(path, s) for s in pipeline_stages(NUM_LAYERS, 2)]
    experts = sum(len(w.moe.gate_up) + len(w.moe.down) for w in models[1].layers if w.moe)
    offloaded = OffloadedWeights(models[1])
    assert len(offloaded.slots) >= experts > 0
    offloaded.restore()
    got, _ = run_chain(models, steps)
    for ours, want in zip(got, tp1, strict=True):
        torch.testing.assert_close(ours, want, atol=1e-5, rtol=0)


def test_a_stage_sleeps_and_wakes(whole_runs):
    """sleep.py's level 1 walks a stage's tensors (no embedding or no head among them).

    NOTE: within 1e-5, not bit for bit: the tensors read back from the sleep file land at
    other alignments than torch's allocations, and a product's summation order may follow
    the alignment (the whole model after a wake differs from itself as much)."""
    path, steps, want = whole_runs("llama")
    models = [load(path, s) for s in pipeline_stages(NUM_LAYERS, 2)]
    for model in models:
        held = weight_slots(model)
        offloaded = OffloadedWeights(model)
        assert len(offloaded.slots) == len(held) > 4 * model.num_local_layers
        assert all(slot.get() is None for slot in offloaded.slots)
        offloaded.restore()
        assert all(slot.get() is not None for slot in weight_slots(model))
    got, _ = run_chain(models, steps)
    for ours, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_llava_vision_tower_is_the_first_stages(tmp_path):
    path = make_model(tmp_path / "llava", ModelShape(arch="llava", num_layers=3))
    whole = load(path)
    first_stage, last_stage = pipeline_stages(3, 2, "1,2")
    first, last = load(path, first_stage), load(path, last_stage)
    assert first.vision is not None and last.vision is None and last.projector is None
    vision_reads = [n for n in reads_of(path, last_stage) if "vision" in n or "projector" in n]
    assert not vision_reads
    assert any("vision_tower" in n for n in reads_of(path, first_stage))
    g = torch.Generator().manual_seed(4)
    size = whole.image_size
    pixels = torch.randn(1, 3, size, size, generator=g)
    ids = [5, 6] + [whole.image_token_id] * whole.num_image_tokens + [7, 8, 9]
    steps = [
        forward_batch([(ids, 0, [4, 1, 6, 2])]),
        forward_batch([([11], len(ids), [4, 1, 6, 2])]),
    ]

    def embeds(model):
        with torch.inference_mode():
            rows = model.embed_images(pixels).flatten(0, 1)
            return [model.merge_image_embeds(torch.tensor(ids), rows), None]

    want = run_stage(whole, steps, inputs_embeds=embeds(whole))
    got, _ = run_chain([first, last], steps, inputs_embeds=embeds(first))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    with pytest.raises(ValueError, match=r"stage 1 of 2 holds no vision tower"):
        last.embed_images(pixels)
