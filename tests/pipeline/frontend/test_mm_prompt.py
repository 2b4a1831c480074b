"""Images in prompts: chat image parts and multi_modal_data -> expanded token ids and the
images at their positions, against transformers' LLaVA processor.

A tiny LLaVA folder from `make_model` (its tokenizer has `<image>` as a special token, its
template renders one per image part, its preprocessor_config.json is CLIP's). The pieces
are built with the values the engine reports for that model (EngineInfo), so nothing
here needs the engine.
"""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from PIL import Image

from ringllm.pipeline.config import MultiModalConfig
from ringllm.pipeline.frontend.chat_template import ChatTemplate, ChatTemplateError
from ringllm.pipeline.frontend.image_processor import ImageProcessor
from ringllm.pipeline.frontend.input_processor import chat_prompt, process_prompt
from ringllm.pipeline.frontend.mm_prompt import (
    ImageTokens,
    PixelBudget,
    PromptImages,
    media_policy,
    place_images,
)
from ringllm.pipeline.frontend.tokenizer import Tokenizer
from ringllm.pipeline.messages import EngineInfo, image_hash
from ringllm.tools.make_model import ModelShape, make_model

MAX_MODEL_LEN = 2048
# A template that knows only string content (no loop over parts), as older ones are.
STRING_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("llava") / "llava", ModelShape(arch="llava"))


@pytest.fixture(scope="module")
def config_json(llava):
    return json.loads((llava / "config.json").read_text())


@pytest.fixture(scope="module")
def tokenizer(llava):
    return Tokenizer.from_folder(llava)


def engine_info(llava, config_json, max_model_len=MAX_MODEL_LEN, takes_images=True):
    """What the engine reports for this model (a text-only one: no image token)."""
    return EngineInfo(
        model_path=llava,
        max_model_len=max_model_len,
        vocab_size=config_json["text_config"]["vocab_size"],
        num_blocks=64,
        block_size=16,
        eos_token_ids=(2,),
        image_token_id=config_json["image_token_index"] if takes_images else -1,
        num_image_tokens=config_json["image_seq_length"] if takes_images else 0,
    )


@pytest.fixture
def make_images(llava, config_json, tokenizer):
    made = []

    def make(max_model_len=MAX_MODEL_LEN, **multimodal):
        info = engine_info(llava, config_json, max_model_len)
        images = PromptImages.for_model(info, tokenizer, MultiModalConfig(**multimodal), llava)
        made.append(images)
        return images

    yield make
    for images in made:
        images.shutdown()


def encode_with(tokenizer):
    return lambda text, add_special_tokens: tokenizer.encode(text, add_special_tokens)


def picture(seed: int, size=(48, 40), mode="RGB") -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels).convert(mode)


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def url_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts) -> list[dict]:
    content = [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


def runs_of_image_tokens(ids, token_id):
    """(start, length) of each run of the image token."""
    runs, start = [], None
    for i, t in enumerate([*ids, -1]):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


# -- expansion --------------------------------------------------------------------------

TOKENS = ImageTokens(token_id=9, text="<image>", num_tokens=3)


@pytest.mark.parametrize(
    ("ids", "num_images", "expanded", "offsets"),
    [
        ([1, 9, 2], 1, [1, 9, 9, 9, 2], [1]),
        ([9, 1, 2, 9, 3], 2, [9, 9, 9, 1, 2, 9, 9, 9, 3], [0, 5]),
        ([1, 9, 9, 2], 2, [1, 9, 9, 9, 9, 9, 9, 2], [1, 4]),  # side by side
        ([1, 9, 9, 9, 2, 9, 9, 9], 2, [1, 9, 9, 9, 2, 9, 9, 9], [1, 5]),  # already expanded
        ([1, 2, 3], 0, [1, 2, 3], []),
    ],
)
def test_each_image_token_becomes_num_image_tokens(ids, num_images, expanded, offsets):
    assert place_images(ids, TOKENS, num_images, "prompt") == (expanded, offsets)


@pytest.mark.parametrize(
    ("ids", "num_images", "match"),
    [
        ([1, 9, 2], 0, r"holds 1 image token\(s\) \('<image>'\) for 0 image\(s\)"),
        ([1, 9, 2, 9], 1, r"holds 2 image token\(s\) \('<image>'\) for 1 image\(s\)"),
        ([1, 2], 2, r"holds 0 image token\(s\) \('<image>'\) for 2 image\(s\)"),
        ([9, 9, 1, 9, 9, 9, 9], 2, r"holds 6 image token\(s\)"),  # 6 = 2 x 3, not two runs
    ],
)
def test_a_count_mismatch_names_both_counts(ids, num_images, match):
    with pytest.raises(ValueError, match="^prompt: " + match):
        place_images(ids, TOKENS, num_images, "prompt")


# -- chat parts -------------------------------------------------------------------------


def test_one_and_two_images_as_transformers_processes_them(llava, tokenizer, make_images):
    from transformers import AutoProcessor

    images = make_images()
    template = ChatTemplate.from_folder(llava)
    processor = AutoProcessor.from_pretrained(llava)
    first, second = picture(1), picture(2, size=(30, 64), mode="RGBA")
    for parts, pictures in [
        ((url_part(data_url(first)), "what is it?"), [first]),
        (
            ("compare", url_part(data_url(first)), "with", url_part(data_url(second))),
            [first, second],
        ),
    ]:
        messages = user(*parts)
        prompt = chat_prompt(template, encode_with(tokenizer), messages, images=images)
        hf_messages = [
            {
                "role": "user",
                "content": [
                    {"type": "image"} if "image_url" in p else p for p in messages[0]["content"]
                ],
            }
        ]
        text = processor.apply_chat_template(hf_messages, add_generation_prompt=True)
        expected = processor(text=text, images=pictures, return_tensors="np")
        assert prompt.token_ids == expected.input_ids[0].tolist()
        runs = runs_of_image_tokens(prompt.token_ids, images.tokens.token_id)
        assert [(m.offset, m.length) for m in prompt.mm_inputs] == runs
        assert all(length == images.tokens.num_tokens for _, length in runs)
        for image, pixels in zip(prompt.mm_inputs, expected.pixel_values, strict=True):
            np.testing.assert_array_equal(image.pixel_values, pixels)
            assert image.hash == image_hash(pixels)
    assert prompt.mm_inputs[0].hash != prompt.mm_inputs[1].hash


def test_the_same_image_has_the_same_hash_whatever_its_source(llava, tokenizer, make_images):
    images = make_images()
    template = ChatTemplate.from_folder(llava)
    image = picture(3)
    messages = user(
        url_part(data_url(image)),
        "and",
        {"type": "image_pil", "image_pil": image},
        "and",
        {"type": "image", "image": image},
    )
    prompt = chat_prompt(template, encode_with(tokenizer), messages, images=images)
    assert len({m.hash for m in prompt.mm_inputs}) == 1
    assert [m.offset for m in prompt.mm_inputs] == [
        start for start, _ in runs_of_image_tokens(prompt.token_ids, images.tokens.token_id)
    ]


def test_images_load_on_the_media_pool(llava, tokenizer, make_images):
    images = make_images(media_loading_threads=2)
    threads = []
    preprocess = images.processor.preprocess

    def recording(image):
        threads.append(threading.current_thread().name)
        return preprocess(image)

    images.processor.preprocess = recording
    messages = user(*[url_part(data_url(picture(i))) for i in range(3)])
    chat_prompt(ChatTemplate.from_folder(llava), encode_with(tokenizer), messages, images=images)
    assert len(threads) == 3 and all(name.startswith("ringllm-media") for name in threads)


def test_a_text_only_model_refuses_image_parts(llava, tokenizer):
    template = ChatTemplate.from_folder(llava)
    for part in (url_part(data_url(picture(0))), {"type": "image_pil", "image_pil": picture(0)}):
        with pytest.raises(
            ChatTemplateError,
            match=r"^messages\[0\]\.content\[1\]: content part type '\w+' is not supported; "
            "this model does not take images",
        ):
            chat_prompt(template, encode_with(tokenizer), user("look", part))


def test_more_images_than_the_limit_are_refused_before_any_is_read(llava, tokenizer, make_images):
    images = make_images(limit_mm_per_prompt={"image": 2})
    unreachable = url_part("http://127.0.0.1:1/never-fetched.png")  # http is not even allowed
    with pytest.raises(ValueError, match=r"^messages: 3 images; at most 2 per prompt \(--limit-mm"):
        chat_prompt(
            ChatTemplate.from_folder(llava),
            encode_with(tokenizer),
            user(unreachable, unreachable, unreachable, "three"),
            images=images,
        )
    none = make_images(limit_mm_per_prompt={"image": 0})
    with pytest.raises(ValueError, match=r"multi_modal_data.image: 1 images; at most 0"):
        process_prompt(
            {"prompt": "<image>", "multi_modal_data": {"image": picture(0)}},
            encode_with(tokenizer),
            513,
            none,
        )


def test_a_bad_image_is_a_value_error_naming_its_part(llava, tokenizer, make_images):
    images = make_images()
    template = ChatTemplate.from_folder(llava)
    not_an_image = "data:image/png;base64," + base64.b64encode(b"hello, not a png").decode()
    png = io.BytesIO()
    picture(0).save(png, "PNG")
    truncated = "data:image/png;base64," + base64.b64encode(png.getvalue()[:300]).decode()
    cases = [
        (not_an_image, "not an image in a supported format"),
        (truncated, "truncated or corrupt"),
        ("file:///etc/passwd", "local files are not allowed"),
        ("http://127.0.0.1:1/a.png", "http URLs are not allowed"),
    ]
    for url, why in cases:
        with pytest.raises(ValueError, match=rf"^messages\[0\]\.content\[1\]\.image_url: .*{why}"):
            chat_prompt(template, encode_with(tokenizer), user("x", url_part(url)), images=images)
    with pytest.raises(ValueError, match=r"content\[0\]\.image_pil: expected a PIL image"):
        chat_prompt(
            template,
            encode_with(tokenizer),
            user({"type": "image_pil", "image_pil": "x"}),
            images=images,
        )


def test_a_stray_image_token_in_the_text_is_a_count_mismatch(llava, tokenizer, make_images):
    images = make_images()
    with pytest.raises(
        ValueError, match=r"^messages: holds 2 image token\(s\) \('<image>'\) for 1"
    ):
        chat_prompt(
            ChatTemplate.from_folder(llava),
            encode_with(tokenizer),
            user(url_part(data_url(picture(0))), "what is <image>?"),
            images=images,
        )


def test_the_expanded_prompt_must_fit_before_images_are_read(
    llava, config_json, tokenizer, make_images
):
    images = make_images(max_model_len=20)  # one image alone fills 16 positions
    parts = [{"type": "image_pil", "image_pil": picture(0)}] * 2
    with pytest.raises(
        ValueError, match=r"^messages: \d+ tokens leave no room for output within max_model_len 20"
    ):
        chat_prompt(
            ChatTemplate.from_folder(llava),
            encode_with(tokenizer),
            user(*parts, "hi"),
            images=images,
        )


def test_a_string_only_template_gets_the_placeholders_before_the_text(tokenizer, make_images):
    images = make_images()
    template = ChatTemplate(STRING_TEMPLATE)
    assert not template.takes_content_lists(STRING_TEMPLATE, "<image>")
    first, second = picture(0), picture(1)
    messages = user(
        "first",
        {"type": "image_pil", "image_pil": first},
        "second",
        {"type": "image_pil", "image_pil": second},
    )
    text = template.render(messages, image_placeholder="<image>")
    assert text == "user: <image>\n<image>\nfirst\nsecond\nassistant:"  # as vLLM's "string" format
    prompt = chat_prompt(template, encode_with(tokenizer), messages, images=images)
    assert len(prompt.mm_inputs) == 2
    processor = images.processor
    np.testing.assert_array_equal(prompt.mm_inputs[1].pixel_values, processor.preprocess(second))
    # a placeholder the text holds already stands for one of the images
    messages = user("look: <image>", {"type": "image_pil", "image_pil": first})
    assert (
        template.render(messages, image_placeholder="<image>") == "user: look: <image>\nassistant:"
    )


def test_a_template_that_walks_parts_gets_them_in_order(llava):
    template = ChatTemplate.from_folder(llava)
    text = template.select()
    assert template.takes_content_lists(text, "<image>")
    messages = user("a", {"type": "image_pil", "image_pil": picture(0)}, "b")
    assert template.render(messages, image_placeholder="<image>") == (
        "<|im_start|>user\na<image>b<|im_end|>\n<|im_start|>assistant\n"
    )
    # text-only messages stay strings, so continuing the last one still works
    messages.append({"role": "assistant", "content": [{"type": "text", "text": "It is"}]})
    rendered = template.render(
        messages,
        add_generation_prompt=False,
        continue_final_message=True,
        image_placeholder="<image>",
    )
    assert rendered.endswith("<|im_start|>assistant\nIt is")


# -- multi_modal_data ---------------------------------------------------------------------


def test_multi_modal_data_with_text_and_with_token_ids(tokenizer, make_images):
    images = make_images()
    encode = encode_with(tokenizer)
    one, two = picture(5), picture(6)
    text_prompt = {
        "prompt": "USER: <image>\nWhat is this? ASSISTANT:",
        "multi_modal_data": {"image": one},
    }
    by_text = process_prompt(text_prompt, encode, 513, images)
    ids = tokenizer.encode(text_prompt["prompt"])
    by_ids = process_prompt(
        {"prompt_token_ids": ids, "multi_modal_data": {"image": [one]}}, encode, 513, images
    )
    assert by_text.token_ids == by_ids.token_ids and by_text.mm_inputs == by_ids.mm_inputs
    assert by_text.text == text_prompt["prompt"] and len(by_text.token_ids) == len(ids) + 15
    # its expanded ids again (as a RequestOutput shows them) with the same image: the same
    again = process_prompt(
        {"prompt_token_ids": by_ids.token_ids, "multi_modal_data": {"image": one}},
        encode,
        513,
        images,
    )
    assert again.token_ids == by_ids.token_ids and again.mm_inputs == by_ids.mm_inputs
    both = process_prompt(
        {"prompt": "<image> and <image>", "multi_modal_data": {"image": [one, two]}},
        encode,
        513,
        images,
    )
    assert [m.hash for m in both.mm_inputs] == [
        by_text.mm_inputs[0].hash,
        image_hash(images.processor.preprocess(two)),
    ]


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        (
            {"prompt": "<image> <image>", "multi_modal_data": {"image": "x"}},
            r"multi_modal_data.image: must be a PIL image or a list",
        ),
        (
            {"prompt": "<image>", "multi_modal_data": {"image": ["x"]}},
            r"multi_modal_data.image\[0\]: expected a PIL image, got str",
        ),
        (
            {"prompt": "<image>", "multi_modal_data": {"video": []}},
            r"multi_modal_data: unknown modality \['video'\]",
        ),
        ({"prompt": "<image>", "multi_modal_data": [1]}, r"multi_modal_data: must be a dict"),
        (
            {"prompt": "<image> <image>", "multi_modal_data": {}},
            r"^prompt: holds 2 image token\(s\) \('<image>'\) for 0",
        ),
        ("hello <image>", r"^prompt: holds 1 image token\(s\) \('<image>'\) for 0"),
        (
            {"prompt": "<image> <image>", "multi_modal_data": {"image": picture(0)}},
            r"^prompt: holds 2 image token\(s\) \('<image>'\) for 1",
        ),
    ],
)
def test_bad_multi_modal_data_is_a_value_error(tokenizer, make_images, prompt, match):
    with pytest.raises(ValueError, match=match):
        process_prompt(prompt, encode_with(tokenizer), 513, make_images())


def test_multi_modal_data_for_a_text_only_model(tokenizer):
    prompt = {"prompt": "hello", "multi_modal_data": {"image": picture(0)}}
    with pytest.raises(ValueError, match="^multi_modal_data: this model does not take images"):
        process_prompt(prompt, encode_with(tokenizer), 513, None)


# -- the pieces from the engine's numbers and the flags -----------------------------------


def test_prompt_images_only_for_a_model_that_takes_them(llava, config_json, tokenizer, tmp_path):
    text_only = engine_info(llava, config_json, takes_images=False)
    assert PromptImages.for_model(text_only, tokenizer, MultiModalConfig(), llava) is None
    info = engine_info(llava, config_json)
    images = PromptImages.for_model(info, tokenizer, MultiModalConfig(), llava)
    try:
        assert images.tokens == ImageTokens(
            config_json["image_token_index"], "<image>", config_json["image_seq_length"]
        )
        assert images.processor.output_hw == ImageProcessor.from_folder(llava).output_hw
        assert images.limit == 4
    finally:
        images.shutdown()
    (tmp_path / "tokenizer.json").write_bytes((llava / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="preprocessor_config.json: not found"):
        PromptImages.for_model(info, tokenizer, MultiModalConfig(), tmp_path)


def test_media_policy_from_the_flags(tmp_path):
    policy = media_policy(MultiModalConfig())
    assert policy.allowed_local_media_path is None and not policy.allow_http
    policy = media_policy(
        MultiModalConfig(
            allowed_local_media_path=str(tmp_path),
            allowed_media_domains="a.example.com, B.example.com",
            media_fetch_timeout_s=2.5,
            max_media_bytes=1000,
            max_image_pixels=4096,
        )
    )
    assert policy.allowed_local_media_path == str(tmp_path)
    assert policy.allow_http and policy.allowed_domains == ("a.example.com", "b.example.com")
    assert (policy.fetch_timeout_s, policy.max_bytes, policy.max_pixels) == (2.5, 1000, 4096)
    assert media_policy(MultiModalConfig(allowed_media_domains="*")).allows_host("any.where")


# -- memory ------------------------------------------------------------------------------


def test_images_decode_together_only_within_the_pixel_budget(llava, tokenizer, make_images):
    """Four media threads, four 64 x 64 images, a budget of two of them: at most two are
    decoded and preprocessed at once (without the budget all four threads overlap)."""
    images = make_images(media_loading_threads=4, max_image_pixels=2 * 64 * 64)
    running, most = [0], [0]
    lock = threading.Lock()
    preprocess = images.processor.preprocess

    def slow(image):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.1)  # long enough that every free thread would join in
        with lock:
            running[0] -= 1
        return preprocess(image)

    images.processor.preprocess = slow
    messages = user(*[url_part(data_url(picture(i, size=(64, 64)))) for i in range(4)])
    chat_prompt(ChatTemplate.from_folder(llava), encode_with(tokenizer), messages, images=images)
    assert most[0] == 2
    assert images.pixels.held == 0


def test_one_image_runs_whatever_its_size_and_a_failure_gives_its_pixels_back():
    budget = PixelBudget(100)
    with budget.hold(500):  # nothing else held: it runs
        assert budget.held == 500
    with pytest.raises(RuntimeError), budget.hold(60):
        raise RuntimeError("a decode failed")
    assert budget.held == 0
    waiting = threading.Event()
    with budget.hold(60):
        other = threading.Thread(target=lambda: budget.hold(60).__enter__() or waiting.set())
        other.start()
        assert not waiting.wait(0.2)  # 60 + 60 > 100: it waits for the first
    assert waiting.wait(5)
    other.join()


RSS_SCRIPT = """
import base64, io, json, sys
from PIL import Image
from ringllm.pipeline.config import MultiModalConfig
from ringllm.pipeline.frontend.mm_prompt import ImageSource, PromptImages, ImageTokens
from ringllm.pipeline.frontend.image_processor import ImageProcessor

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024

buffer = io.BytesIO()
Image.new("RGB", (4096, 4096), (120, 30, 200)).save(buffer, "PNG")
url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
images = PromptImages(
    ImageTokens(9, "<image>", 3), ImageProcessor.from_folder(sys.argv[1]),
    MultiModalConfig(media_loading_threads=4), 2048,
)
sources = [ImageSource({"type": "image_url", "image_url": {"url": url}}, "x")] * 8
images.load(sources[:1], [0])
before = rss_mib()
for _ in range(2):
    images.load(sources, list(range(8)))
print(json.dumps({"kept_mib": rss_mib() - before}))
"""


def test_large_images_leave_the_heap_as_they_found_it(llava):
    """Eight 4,096 x 4,096 PNGs on four threads, twice: 48 MiB of RGB each, decoded and
    freed on the media threads; their arenas keep none of it (without the trim, 4 threads
    kept about 4 x 70 MiB)."""
    result = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(llava)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    kept = json.loads(result.stdout.strip().splitlines()[-1])["kept_mib"]
    assert kept < 60, f"the media threads kept {kept:.0f} MiB after their images"
