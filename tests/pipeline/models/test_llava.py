"""LLaVA against transformers: images in, logits out, over the paged KV cache.

The oracle is transformers' own LlavaForConditionalGeneration (a tiny random one saved
with save_pretrained, or `ringllm make-model --arch llava`). ringllm runs the prompts as
prefill chunks split at odd points, inside images too (each chunk takes its slice of the
merged embeddings), then greedy decode steps; every logit row must equal transformers'
(float32: max abs diff <= 1e-4) and the greedy tokens its `generate`.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
)

from ringllm.pipeline.config import ModelConfig
from ringllm.pipeline.models.forward_batch import ForwardBatch
from ringllm.pipeline.ops import get_ops
from ringllm.pipeline.worker.model_loader import load_model
from ringllm.pipeline.worker.model_runner import allocate_kv_cache
from ringllm.tools.make_model import ModelShape, make_model

BLOCK_SIZE = 8
NUM_BLOCKS = 48
NUM_NEW_TOKENS = 32
IMAGE_TOKEN = 150
TOKEN_IDS_BELOW = 150  # text tokens of the prompts: never the image token
VISION = dict(
    image_size=32,
    patch_size=8,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=2,
)
TEXT = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def make_hf_llava(folder, seed=0, **llava_fields):
    """A seeded tiny LLaVA saved by transformers; weights rescaled so the logits are far
    from uniform (greedy decoding then has clear winners)."""
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION),
        text_config=LlamaConfig(**TEXT),
        image_token_index=IMAGE_TOKEN,
        **llava_fields,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * p[0].numel() ** -0.5)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)
    return model


def load_ringllm(folder):
    loaded = load_model(ModelConfig(model=str(folder), dtype="float32"), "cpu", get_ops("cpu"))
    return loaded.model


def kv_cache_of(model):
    shape = (NUM_BLOCKS, model.num_kv_heads, BLOCK_SIZE, model.head_dim)
    return allocate_kv_cache(len(model.layers), shape, torch.float32, "cpu")


def forward_batch(chunks):
    """chunks: (token_ids, num_computed, block_ids) per request, one-token decodes first."""
    ids, positions, slots, starts, seq_lens = [], [], [], [0], []
    for tokens, done, blocks in chunks:
        for pos in range(done, done + len(tokens)):
            positions.append(pos)
            slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        ids += tokens
        starts.append(len(ids))
        seq_lens.append(done + len(tokens))
    width = max(len(b) for _, _, b in chunks)
    tables = [list(b) + [0] * (width - len(b)) for _, _, b in chunks]
    num_decodes = 0
    while num_decodes < len(chunks) and len(chunks[num_decodes][0]) == 1:
        num_decodes += 1
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        num_decodes=num_decodes,
        logits_indices=torch.arange(len(ids), dtype=torch.int64),
    )


def image_prompt(model, pieces, seed):
    """pieces: text lengths and "image"s -> (token ids, pixel values [num_images, 3, S, S])."""
    g = torch.Generator().manual_seed(seed)
    ids, num_images = [], 0
    for piece in pieces:
        if piece == "image":
            ids += [model.image_token_id] * model.num_image_tokens
            num_images += 1
        else:
            ids += torch.randint(0, TOKEN_IDS_BELOW, (piece,), generator=g).tolist()
    size = model.image_size
    return ids, torch.randn(num_images, 3, size, size, generator=g)


def run_chunked_then_greedy(model, prompts, cuts, blocks, num_new_tokens=NUM_NEW_TOKENS):
    """prompts: (ids, pixel_values); cuts[i]: prompt i's chunk ends. Prefill chunk by
    chunk (the requests still prefilling in one batch), then greedy decodes all together.
    Returns per prompt: (all prompt logits [len, vocab], decode logits [n - 1, vocab], tokens)."""
    kv = kv_cache_of(model)
    with torch.inference_mode():
        image_rows = [model.embed_images(pixels).flatten(0, 1) for _, pixels in prompts]
        prompt_logits = [[] for _ in prompts]
        done = [0] * len(prompts)
        for step in range(max(len(c) for c in cuts)):
            chunks, embeds, owners = [], [], []
            for i, (ids, _) in enumerate(prompts):
                if step >= len(cuts[i]):
                    continue
                chunk = ids[done[i] : cuts[i][step]]
                first = sum(t == model.image_token_id for t in ids[: done[i]])
                count = sum(t == model.image_token_id for t in chunk)
                rows = image_rows[i][first : first + count]
                embeds.append(model.merge_image_embeds(torch.tensor(chunk), rows))
                chunks.append((chunk, done[i], blocks[i]))
                owners.append((i, len(chunk)))
                done[i] = cuts[i][step]
            order = sorted(range(len(chunks)), key=lambda j: len(chunks[j][0]) != 1)
            batch = forward_batch([chunks[j] for j in order])
            hidden = model.forward(batch, kv, inputs_embeds=torch.cat([embeds[j] for j in order]))
            logits = model.compute_logits(hidden).split([owners[j][1] for j in order])
            for j, rows in zip(order, logits, strict=True):
                prompt_logits[owners[j][0]].append(rows)
        prompt_logits = [torch.cat(rows) for rows in prompt_logits]
        tokens = [[int(rows[-1].argmax())] for rows in prompt_logits]
        decode_logits = [[] for _ in prompts]
        for _ in range(num_new_tokens - 1):
            chunks = [
                ([tokens[i][-1]], len(ids) + len(tokens[i]) - 1, blocks[i])
                for i, (ids, _) in enumerate(prompts)
            ]
            logits = model.compute_logits(model.forward(forward_batch(chunks), kv))  # text only
            for i in range(len(prompts)):
                decode_logits[i].append(logits[i])
                tokens[i].append(int(logits[i].argmax()))
    decode_logits = [torch.stack(rows) for rows in decode_logits]
    return list(zip(prompt_logits, decode_logits, tokens, strict=True))


def check_against_transformers(hf, prompts, results, num_new_tokens=NUM_NEW_TOKENS):
    hf.generation_config.eos_token_id = None  # both sides make exactly num_new_tokens
    for (ids, pixels), (prompt_logits, decode_logits, tokens) in zip(prompts, results, strict=True):
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            full = hf(input_ids=input_ids, pixel_values=pixels).logits[0]
            out = hf.generate(
                input_ids=input_ids,
                pixel_values=pixels,
                max_new_tokens=num_new_tokens,
                do_sample=False,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        assert tokens == out.sequences[0, len(ids) :].tolist(), "greedy tokens differ"
        assert prompt_logits.shape == full.shape
        assert (prompt_logits - full).abs().max().item() <= 1e-4, "prompt logits differ"
        steps = torch.cat([o[0:1] for o in out.logits[1:]])  # logits after each new token
        assert (decode_logits - steps).abs().max().item() <= 1e-4, "decode logits differ"


# One image, then two; the cuts fall inside images (positions 5..20, 3..18 and 25..40).
PIECES = ([5, "image", 4], [3, "image", 6, "image", 2])
CUTS = ((9, 25), (2, 12, 30, 31, 43))
BLOCKS = ([7, 3, 30, 11, 19, 2, 25, 40], [1, 22, 8, 14, 33, 5, 27, 12, 45, 17])


@pytest.mark.parametrize(
    "fields",
    [
        {},  # LLaVA-1.5: feature layer -2, CLS dropped, gelu projector
        dict(
            vision_feature_select_strategy="full",
            vision_feature_layer=[-1, 1],
            projector_hidden_act="quick_gelu",
        ),
    ],
    ids=["llava-1.5", "full-two-layers"],
)
def test_float32_matches_transformers(tmp_path, fields):
    hf = make_hf_llava(tmp_path, **fields)
    model = load_ringllm(tmp_path)
    strategy = fields.get("vision_feature_select_strategy", "default")
    assert model.num_image_tokens == 16 + (strategy == "full")
    prompts = [image_prompt(model, pieces, seed=i) for i, pieces in enumerate(PIECES)]
    cuts = CUTS if strategy == "default" else ((10, 26), (2, 12, 31, 32, 45))
    results = run_chunked_then_greedy(model, prompts, cuts, BLOCKS)
    check_against_transformers(hf, prompts, results)


def test_text_only_forward_is_the_decoder(tmp_path):
    """Without inputs_embeds, forward looks the ids up: the same as merged embeddings of
    a prompt without images."""
    make_hf_llava(tmp_path)
    model = load_ringllm(tmp_path)
    ids = list(range(20, 33))
    batch = forward_batch([(ids, 0, [4, 9])])
    with torch.inference_mode():
        plain = model.forward(batch, kv_cache_of(model))
        merged = model.merge_image_embeds(torch.tensor(ids), torch.empty(0, TEXT["hidden_size"]))
        embedded = model.forward(batch, kv_cache_of(model), inputs_embeds=merged)
    assert torch.equal(plain, embedded)


# transformers 5 saves the older layout with the tower's `vision_model.` level dropped
LAYOUTS = {
    "transformers-4.52": [
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", "model.vision_tower.vision_model."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    ],
    "older": [("vision_tower.", "vision_tower.vision_model.")],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_both_weight_name_layouts_load(tmp_path, layout):
    saved, renamed = tmp_path / "saved", tmp_path / "renamed"
    make_hf_llava(saved)
    shutil.copytree(saved, renamed)
    weights = load_file(saved / "model.safetensors")
    assert any(n.startswith("language_model.model.") for n in weights)  # what was saved

    def rename(name):
        for old, new in LAYOUTS[layout]:
            if name.startswith(old):
                return new + name.removeprefix(old)
        return name

    save_file({rename(n): t for n, t in weights.items()}, renamed / "model.safetensors")
    ids, pixels = image_prompt(load_ringllm(saved), [3, "image", 2], seed=5)
    outputs = []
    for folder in (saved, renamed):
        model = load_ringllm(folder)
        with torch.inference_mode():
            embeds = model.merge_image_embeds(
                torch.tensor(ids), model.embed_images(pixels).flatten(0, 1)
            )
            hidden = model.forward(
                forward_batch([(ids, 0, [0, 1, 2])]), kv_cache_of(model), inputs_embeds=embeds
            )
            outputs.append(model.compute_logits(hidden))
        hf = LlavaForConditionalGeneration.from_pretrained(folder).eval()  # a real layout
        with torch.no_grad():
            full = hf(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
        assert (outputs[-1] - full).abs().max().item() <= 1e-4
    assert torch.equal(outputs[0], outputs[1])


def edit_config(folder, edit):
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda c: c.update(vision_feature_select_strategy="cls"),
            "vision_feature_select_strategy",
        ),
        (lambda c: c.pop("vision_config"), "'vision_config'"),
        (lambda c: c.pop("text_config"), "'text_config'"),
        (lambda c: c.update(vision_feature_layer=-5), "vision_feature_layer -5"),
        (lambda c: c["vision_config"].update(hidden_act="swish"), "hidden_act"),
        (lambda c: c["vision_config"].update(model_type="siglip_vision_model"), "siglip"),
        (lambda c: c.update(image_token_index=160), "image_token_index 160"),
    ],
    ids=["strategy", "no-vision", "no-text", "layer", "act", "tower", "token"],
)
def test_bad_config_is_a_clear_value_error(tmp_path, edit, message):
    make_hf_llava(tmp_path)
    edit_config(tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        load_ringllm(tmp_path)


def test_make_model_llava_loads_in_transformers_and_ringllm(tmp_path):
    path = make_model(tmp_path / "llava", ModelShape(arch="llava"))
    hf, info = LlavaForConditionalGeneration.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), f"transformers loaded it with {info}"
    model = load_ringllm(path)
    config = json.loads((path / "config.json").read_text())
    assert model.image_token_id == config["image_token_index"]
    prompt = image_prompt(model, [4, "image", 3], seed=2)
    results = run_chunked_then_greedy(
        model, [prompt], [(11, 23)], [[5, 1, 9, 13]], num_new_tokens=8
    )
    check_against_transformers(hf.eval(), [prompt], results, num_new_tokens=8)


def test_make_model_llava_tokenizer_template_and_processor(tmp_path):
    from PIL import Image
    from transformers import AutoProcessor, AutoTokenizer, CLIPImageProcessor

    path = make_model(tmp_path / "llava", ModelShape(arch="llava"))
    config = json.loads((path / "config.json").read_text())
    image_id, num_image_tokens = config["image_token_index"], config["image_seq_length"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.convert_tokens_to_ids("<image>") == image_id
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n<image>what is it?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode(text).count(image_id) == 1
    image = Image.new("RGB", (48, 40), (200, 30, 90))
    pixels = CLIPImageProcessor.from_pretrained(path)(image, return_tensors="pt").pixel_values
    assert pixels.shape == (1, 3, 32, 32)
    processor = AutoProcessor.from_pretrained(path)
    expanded = processor(text=text, images=image, return_tensors="pt")
    assert expanded.input_ids[0].tolist().count(image_id) == num_image_tokens
    assert num_image_tokens == load_ringllm(path).num_image_tokens
