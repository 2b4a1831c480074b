"""Quantized matrices in whole models: a GGUF's blocks across tensor-parallel ranks,
`--quantization int8` of a float checkpoint, and a bfloat16 checkpoint's matrices as the
AMX tile unit's tiles, each against the model it stands for."""

from __future__ import annotations

import pytest
import torch

from ringllm.pipeline import LLM, SamplingParams
from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.models.demo_model import demo_model_path
from ringllm.pipeline.models.linear import bf16_layout, layout
from ringllm.pipeline.models.quant_weights import BF16_TILES
from ringllm.pipeline.ops import quant
from ringllm.pipeline.worker.model_runner import ModelRunner, RunnerRequest
from ringllm.tools.make_gguf import make_gguf

PROMPTS = [[5, 6, 7, 8], list(range(30, 75))]
# a bfloat16 checkpoint's matrices where this process multiplies bf16 weights itself
BF16_LAYOUT = bf16_layout(quant.default_kernel_set())
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def tiny_gguf(model_factory, tmp_path_factory):
    """The tiny llama (heads 4, kv heads 2, hidden 64: every split by 2 is whole Q8_0
    blocks), its matrices in Q8_0 and its MLP's down projection in Q4_0: fused parts of one
    format and of two."""
    out = tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf"
    folder = model_factory("llama", rope_scaling="none")
    return make_gguf(folder, out, "q8_0", {"*ffn_down*": "q4_0"})


def assert_two_ranks_agree_with_one(model, logprob_abs: float = 1e-3) -> None:
    """Greedy tokens equal, logprobs within `logprob_abs`: every rank holds its shard in the
    same layout as the whole matrix, so only the all-reduce's order of the row-parallel
    partial sums differs."""
    args = dict(model=str(model), num_gpu_blocks_override=64)
    ref = LLM(**args).generate(PROMPTS, GREEDY, use_tqdm=False)
    with LLM(tensor_parallel_size=2, **args) as llm:
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for ours, theirs in zip(got, ref, strict=True):
        a, b = ours.outputs[0], theirs.outputs[0]
        assert a.token_ids == b.token_ids
        for lp_a, lp_b in zip(a.logprobs, b.logprobs, strict=True):
            for token in lp_a.keys() & lp_b.keys():
                assert lp_a[token].logprob == pytest.approx(lp_b[token].logprob, abs=logprob_abs)


def test_tensor_parallel_ranks_read_their_blocks_and_agree(tiny_gguf):
    assert_two_ranks_agree_with_one(tiny_gguf)


def _runner(**kwargs) -> ModelRunner:
    runner = ModelRunner(EngineConfig.from_kwargs(num_gpu_blocks_override=8, **kwargs))
    runner.initialize_kv_cache(8)
    return runner


def _logits(runner: ModelRunner | None = None, **kwargs) -> torch.Tensor:
    runner = runner or _runner(**kwargs)
    return runner.execute([RunnerRequest(list(range(1000, 1040)), 0, [3, 1, 6, 0], "all")]).logits


def test_int8_checkpoint_logits_near_the_float32_model():
    """--quantization int8 of the demo model's bf16 folder (one scale per output row,
    activations per group of 32) against the same folder in float32. Measured (AMD EPYC,
    avx512vnni): largest logit error 2.2 on logits up to 33, mean 2.1% of the mean logit,
    the same argmax at 37 of 40 positions: coarser than the Q4_1 file's own blocks (1.5,
    1.2%), since one scale per row of 576 spans the model's outlier columns."""
    path = str(demo_model_path())
    dense = _logits(model=path, dtype="float32")
    runner = _runner(model=path, dtype="float32", quantization="int8")
    # where the tile unit is the process's, its attention runs there (worker/model_loader.py
    # attention_tiles_here); an exact float32 model keeps the vector kernels
    assert runner.ops.attention_tiles == (quant.default_kernel_set() == quant.TILE_SET)
    int8 = _logits(runner)
    err = (int8 - dense).abs()
    assert err.max() / dense.abs().max() < 0.1, err.max()
    assert err.mean() / dense.abs().mean() < 0.035
    assert (int8.argmax(-1) == dense.argmax(-1)).float().mean() >= 0.85


def test_quantization_mistakes_are_clear_errors(tiny_gguf):
    with pytest.raises(ValueError, match="quantization: 'int4' is not one of"):
        EngineConfig.from_kwargs(quantization="int4")
    with pytest.raises(ValueError, match="already quantized"):
        LLM(model=str(tiny_gguf), quantization="int8", num_gpu_blocks_override=8)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_gives_back_and_restores_quantized_weights(tiny_gguf, level):
    """Level 1 takes the packed blocks (and the parts of a mixed-format fused matrix) out
    of the model and puts them back; level 2 reads them from the GGUF again."""
    llm = LLM(model=str(tiny_gguf), enable_sleep_mode=True, num_gpu_blocks_override=64)
    before = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.sleep(level)
    llm.wake_up()
    after = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]


def test_gguf_blocks_go_to_a_gpu_as_they_are_and_run_on_its_kernels(tiny_gguf):
    """On a CUDA device a GGUF matrix is not repacked: its blocks move there as the file
    holds them (shown on the meta device, which needs no GPU) and `linear` multiplies them
    with cuda/quant.py's kernels, which run here through the emulator on CPU blocks: the
    decode GEMV (m <= 8) and the dequantized tiles (m > 8) within float32 summation of the
    exact product, as the CPU's integer kernels are within their activation rounding."""
    import gguf

    from ringllm.pipeline.models.gguf_weights import GGUFWeightSource
    from ringllm.pipeline.models.linear import linear, prepack
    from ringllm.pipeline.models.quant_weights import DeviceBlocks, RowParts, cat_rows

    source = GGUFWeightSource(tiny_gguf)
    names = ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight"]
    blocks = [source.get_blocks(name) for name in names]
    assert [b.qtype for b in blocks] == ["q8_0", "q4_0"]
    on_meta = prepack(blocks[0], device="meta")
    assert isinstance(on_meta, DeviceBlocks) and on_meta.blocks.device.type == "meta"
    assert on_meta.shape == blocks[0].shape and on_meta.blocks.shape == blocks[0].blocks.shape
    with pytest.raises(ValueError, match="int8 runs on the CPU"):
        prepack(torch.ones(64, 64), quantization="int8", device="meta")

    torch.manual_seed(0)
    for b in blocks:
        weight = torch.from_numpy(
            gguf.quants.dequantize(b.blocks.numpy(), gguf.GGMLQuantizationType[b.qtype.upper()])
        ).double()
        on_device = DeviceBlocks(b.qtype, b.n, b.k, b.blocks)  # the emulator's "device"
        on_cpu = prepack(b)
        for m in (3, 12):
            x = torch.randn(m, b.k)
            exact = x.double() @ weight.T
            scale = x.double().abs() @ weight.abs().T
            gpu, cpu = linear(x, on_device), linear(x, on_cpu)
            assert gpu.dtype == torch.float32 and gpu.shape == (m, b.n)
            assert ((gpu.double() - exact).abs() <= 1e-5 * scale + 1e-6).all()
            # the CPU kernels quantize x to int8 per 32: well within 2% of sum |w||x|
            assert ((cpu.double() - exact).abs() <= 0.02 * scale + 1e-6).all()

    # gate | up held as parts (as fused parts of two formats are): each part on the GPU's
    # kernels, the outputs joined in order
    parts = [blocks[0], source.get_blocks(names[0].replace("gate", "up"))]
    fused = prepack(cat_rows(parts))
    on_device = RowParts([DeviceBlocks(b.qtype, b.n, b.k, b.blocks) for b in parts])
    x = torch.randn(2, blocks[0].k)
    assert torch.allclose(linear(x, on_device), linear(x, fused), rtol=0.02, atol=0.02)


def test_fused_parts_of_one_format_are_one_product():
    """q | k | v with v in another format (Q4_K_M's Q6_K v): q and k are joined into one
    matrix beside v, so a step runs two products, not three, and its output is, bit for
    bit, the three parts' (each output row is its own dot products), and within the
    activations' rounding of the dequantized blocks' float64 product."""
    import gguf

    from ringllm.pipeline.models.gguf_weights import GGUFBlocks
    from ringllm.pipeline.models.linear import linear, prepack
    from ringllm.pipeline.models.quant_weights import RowParts, cat_rows
    from ringllm.tools.bench.qgemm import random_blocks

    q, k, v = (GGUFBlocks(t, n, 512, torch.from_numpy(random_blocks(t, n, 512, s)))
               for s, (t, n) in enumerate([("q4_k", 64), ("q4_k", 32), ("q6_k", 32)]))  # fmt: skip
    fused = cat_rows([q, k, v])
    assert isinstance(fused, RowParts) and [(p.qtype, p.n) for p in fused.parts] == [
        ("q4_k", 96),
        ("q6_k", 32),
    ]
    assert cat_rows([q, k]).n == 96  # one format: plain blocks, as before
    apart = prepack(RowParts([q, k, v]))
    joined = prepack(fused)
    assert len(joined.parts) == 2
    weight = torch.cat(
        [
            torch.from_numpy(
                gguf.quants.dequantize(p.blocks.numpy(), gguf.GGMLQuantizationType[p.qtype.upper()])
            )
            for p in (q, k, v)
        ]
    ).double()
    torch.manual_seed(0)
    for m in (1, 3, 12):
        x = torch.randn(m, 512)
        out = linear(x, joined)
        assert out.shape == (m, 128) and torch.equal(out, linear(x, apart))
        exact = x.double() @ weight.T
        assert ((out.double() - exact).abs() <= 0.02 * (x.double().abs() @ weight.abs().T)).all()


@pytest.mark.parametrize("qtype", ["f32", "q8_0"])
def test_a_gemma3_gguf_gives_its_hf_folders_logits(model_factory, tmp_path, qtype):
    """Gemma 3 through make-gguf as llama.cpp writes it (sandwich norms named as llama.cpp
    names them and stored as 1 + w; window, pattern, local rotary base and logit cap in the
    metadata) against transformers on the folder it was made from, over a prompt that
    crosses the 16-key window: F32 matrices (kept float32) within 1e-4, Q8_0 within its
    quantization."""
    from transformers import AutoModelForCausalLM

    folder = model_factory("gemma3")
    path = make_gguf(folder, tmp_path / f"gemma3-{qtype}.gguf", qtype)
    ids = list(range(100, 140))
    runner = ModelRunner(EngineConfig.from_kwargs(model=str(path), num_gpu_blocks_override=16))
    runner.initialize_kv_cache(16)
    ours = runner.execute([RunnerRequest(ids, 0, [3, 1, 6, 0, 9, 12, 2, 5, 8, 10], "all")]).logits
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    err = (ours - want).abs()
    if qtype == "f32":
        assert err.max() <= 1e-4, err.max()
    else:
        assert err.max() / want.abs().max() < 0.05, err.max()
        assert (ours.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("qtype", ["f32", "q8_0"])
def test_a_phi3_gguf_gives_its_hf_folders_logits(model_factory, tmp_path, qtype):
    """Phi-3 as llama.cpp's converter writes it: q | k | v in one attn_qkv, gate | up in
    one ffn_up (split into the Llama loader's parts by rows, q's and k's permuted within
    each head for the partial rotary of 12 of 16 dimensions, blocks moved whole), LongRoPE's
    factors as rope_factors_long / _short, a window of 8 keys. F32 against transformers on
    the folder within 1e-4; Q8_0 against the float32 model dequantized from the same file
    (the activations' int8 rounding the only difference), and TP=2 on its blocks."""
    import json
    import shutil

    folder = tmp_path / "phi3"
    shutil.copytree(model_factory("phi3"), folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(sliding_window=8)
    (folder / "config.json").write_text(json.dumps(config))
    path = make_gguf(folder, tmp_path / f"phi3-{qtype}.gguf", qtype)
    check_gguf_logits(folder, path, qtype, tp2=True)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("qtype", ["f32", "q8_0"])
def test_a_moe_gguf_gives_its_hf_folders_logits(model_factory, tmp_path, name, qtype):
    """Experts as llama.cpp stores them (one 3D tensor per matrix of a layer, the router
    F32, qwen3moe / llama with expert counts in the metadata), read back as E matrices of
    blocks each. F32: transformers' logits on the folder within 1e-4. Q8_0 (the experts'
    down projection in Q4_0): against the float32 model dequantized from the same file,
    the activations' int8 rounding the only difference; a token whose router nearly ties
    may pick another expert on one side (measured on Zen 3: the largest error 3-20% of the
    largest logit, the mean 1.6-2.6% of the mean, the same argmax at 38-39 of 40
    positions), so the mean and the argmax are held, not the largest error. TP=2 (Mixtral)
    cuts every expert's blocks: the same greedy tokens."""
    # llama.cpp's Qwen3-MoE: every layer sparse; experts of 64: whole Q4_0 blocks per rank
    folder = model_factory(name, mlp_only_layers=(), moe_intermediate_size=64)
    overrides = {"*ffn_down*": "q4_0"} if qtype == "q8_0" else {}
    path = make_gguf(folder, tmp_path / f"{name}-{qtype}.gguf", qtype, overrides)
    # one family across two ranks is enough: the cut is the same code
    check_gguf_logits(folder, path, qtype, tp2=name == "mixtral")


def check_gguf_logits(folder, path, qtype: str, tp2: bool) -> None:
    """The GGUF `path` made from HF `folder`: F32 within 1e-4 of transformers' logits on
    the folder; a quantized file against the float32 model dequantized from it (the mean
    error and the argmax), and (`tp2`) the same greedy tokens on two ranks."""
    from transformers import AutoModelForCausalLM

    ids = list(range(100, 140))
    ours = runner_logits(dict(model=str(path)), ids)
    if qtype == "f32":
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        assert (ours - want).abs().max() <= 1e-4, (ours - want).abs().max()
        return
    dense = runner_logits(dict(model=str(path), dtype="float32"), ids)
    err = (ours - dense).abs()
    assert err.mean() / dense.abs().mean() < 0.04, err.mean()
    assert (ours.argmax(-1) == dense.argmax(-1)).float().mean() >= 0.9
    if not tp2:
        return
    args = dict(model=str(path), num_gpu_blocks_override=64)
    ref = LLM(**args).generate(PROMPTS, GREEDY, use_tqdm=False)
    with LLM(tensor_parallel_size=2, **args) as llm:
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for ours_out, theirs in zip(got, ref, strict=True):
        assert ours_out.outputs[0].token_ids == theirs.outputs[0].token_ids


def runner_logits(kwargs: dict, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(EngineConfig.from_kwargs(num_gpu_blocks_override=16, **kwargs))
    runner.initialize_kv_cache(16)
    return runner.execute([RunnerRequest(ids, 0, [3, 1, 6], "all")]).logits


@pytest.mark.skipif(not quant.bf16_tiles_available(), reason="needs AVX512_BF16 or AMX")
def test_a_bf16_checkpoint_runs_on_the_tile_unit_nearer_float32(model_factory):
    """A bfloat16 checkpoint under `--dtype auto`, where the tile unit is this process's:
    its matrices as tiles ("amx-bf16"), float32 activations (each product's rows rounded
    to bfloat16 as the tile unit reads them, nothing else), a bfloat16 KV cache and
    embedding. The demo model's logits are then nearer the float32 model's than the
    bfloat16 run's (bfloat16 activations throughout), and its argmax differs from
    float32's only at near ties. An asked-for dtype, or another kernel set, keeps the
    usual layouts."""
    path = str(demo_model_path())
    runner = _runner(model=path)
    assert runner.model.quantization == BF16_TILES and runner.dtype is torch.float32
    assert runner.kv_dtype is torch.bfloat16 and runner.model.embed.dtype is torch.bfloat16
    assert layout(runner.model.layers[0].qkv) == layout(runner.model.lm_head) == BF16_LAYOUT
    # its attention too where the tile unit is (csrc/attention_tiles.h)
    assert runner.ops.attention_tiles == (quant.default_kernel_set() == quant.TILE_SET)
    dense = _logits(model=path, dtype="float32")
    tiles = _logits(runner)
    bf16 = _logits(model=path, dtype="bfloat16")
    err_tiles, err_bf16 = (tiles - dense).abs(), (bf16.float() - dense).abs()
    # measured (Intel Xeon, AMX): largest error 0.21 against 1.49, mean 0.042 against 0.13,
    # on logits up to 33
    assert err_tiles.mean() < err_bf16.mean() / 2, (err_tiles.mean(), err_bf16.mean())
    assert err_tiles.max() < err_bf16.max(), (err_tiles.max(), err_bf16.max())
    # a different argmax only where float32's top two nearly tie (3 of 40 positions here,
    # gaps 0.009-0.028; bfloat16 activations happen to pick float32's at all 40)
    top2 = dense.topk(2, dim=-1).values
    differ = tiles.argmax(-1) != dense.argmax(-1)
    assert differ.sum() <= 4
    assert ((top2[:, 0] - top2[:, 1])[differ] < 2 * err_tiles.max()).all()
    tiny = model_factory(dtype="bfloat16")
    asked = ModelRunner(EngineConfig.from_kwargs(model=str(tiny), dtype="bfloat16"))
    assert asked.model.quantization is None and asked.dtype is torch.bfloat16
    assert not asked.ops.attention_tiles


def test_bf16_tiles_only_where_the_tile_unit_is_the_default_set(model_factory, monkeypatch):
    """RINGLLM_QUANT_KERNELS naming another set (or a CPU without the tile unit) keeps a
    bfloat16 checkpoint on the usual layouts."""
    monkeypatch.setenv(quant.ENV_KERNELS, "generic")
    tiny = model_factory(dtype="bfloat16")
    runner = ModelRunner(EngineConfig.from_kwargs(model=str(tiny), num_gpu_blocks_override=8))
    assert runner.model.quantization is None
    assert layout(runner.model.layers[0].qkv) not in ("amx-bf16", "avx512-bf16")
    assert not runner.ops.attention_tiles


@pytest.mark.skipif(not quant.bf16_tiles_available(), reason="needs AVX512_BF16 or AMX")
def test_a_bf16_gguf_takes_the_same_tiles_as_its_folder(model_factory, tmp_path):
    """A GGUF's BF16 matrices go to the tile unit as a bfloat16 folder's do (its blocks
    would stay blocks): the same weights, the same products, so the same logits, bit for
    bit, as the folder it was made from."""
    folder = model_factory("llama", dtype="bfloat16", rope_scaling="none")
    path = make_gguf(folder, tmp_path / "tiny-bf16.gguf", "bf16")
    ids = list(range(3, 40))
    # a GGUF keeps its KV cache in float32 on the CPU, the folder in bfloat16: one dtype
    from_gguf = runner_logits(dict(model=str(path), kv_cache_dtype="float32"), ids)
    from_folder = runner_logits(dict(model=str(folder), kv_cache_dtype="float32"), ids)
    assert torch.equal(from_gguf, from_folder)
    runner = ModelRunner(EngineConfig.from_kwargs(model=str(path), num_gpu_blocks_override=8))
    assert runner.model.quantization == "gguf"
    assert layout(runner.model.layers[0].qkv) == BF16_LAYOUT


@pytest.mark.skipif(not quant.bf16_tiles_available(), reason="needs AVX512_BF16 or AMX")
def test_tensor_parallel_ranks_lay_out_their_own_bf16_tiles(model_factory):
    """Each rank lays out its shard of a bfloat16 checkpoint's matrices as tiles (a
    row-parallel shard's k is half the matrix's) and the ranks agree with one process.
    Here every product rounds its input rows to bfloat16, so the all-reduce's order,
    an ulp of float32 in a row-parallel output, can move the next product's input by a
    bfloat16 ulp (2^-8): measured on the AVX-512 BF16 set, logprobs 0.024 apart at most
    (the products themselves within 2e-6 of float64), the greedy tokens the same."""
    folder = model_factory("llama", dtype="bfloat16", rope_scaling="none")
    assert_two_ranks_agree_with_one(folder, logprob_abs=0.05)
