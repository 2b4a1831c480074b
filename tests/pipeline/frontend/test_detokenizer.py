"""IncrementalDetokenizer: streamed deltas add up to the full decode, never a torn character."""

from __future__ import annotations

import random

import pytest
import tok_fixtures as tf
from tokenizers.decoders import DecodeStream

from ringllm.pipeline.frontend.detokenizer import IncrementalDetokenizer
from ringllm.pipeline.frontend.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
MULTIBYTE_CHARS = "éßжω你好世界東京한국🎉👍🏽🚀🦄∑∞→"


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return Tokenizer.from_folder(tf.chatml_folder(tmp_path_factory.mktemp("chatml")))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    folder = tf.write_hf_folder(tmp_path_factory.mktemp("llama"), tf.byte_fallback_bpe(), config)
    return Tokenizer.from_folder(folder)


def _stream(detok, ids, rng, max_chunk=4, check_prefix_of=None):
    """Feed `ids` in random chunks; every partial result must be a prefix of the final text."""
    pieces, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        pieces.append(detok.update(ids[i : i + n]))
        i += n
        if check_prefix_of is not None:
            assert check_prefix_of.startswith("".join(pieces))
    pieces.append(detok.flush())
    return "".join(pieces)


def _random_text(rng, n_chars=40):
    alphabet = "abc xyz,.\n" + MULTIBYTE_CHARS
    return "".join(rng.choice(alphabet) for _ in range(n_chars))


def test_text_round_trips_one_token_at_a_time(chatml):
    text = " ".join(tf.CORPUS[:11])
    ids = chatml.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(chatml, prompt_token_ids=chatml.encode("Q: "))
    deltas = [detok.update([token_id]) for token_id in ids]
    assert "".join(deltas) == text
    assert not any(REPLACEMENT in delta for delta in deltas)
    assert sum(1 for d in deltas if d == "") > 20  # many characters did span several tokens


def test_split_character_is_held_back_until_complete(chatml):
    ids = chatml.encode("a🦄", add_special_tokens=False)
    unicorn_ids = ids[1:] if chatml.decode(ids[:1]) == "a" else pytest.fail("'a' not one token")
    assert len(unicorn_ids) >= 2, "the test needs the emoji split across tokens"
    detok = IncrementalDetokenizer(chatml, prompt_token_ids=[])
    assert detok.update(ids[:1]) == "a"
    for token_id in unicorn_ids[:-1]:
        assert detok.update([token_id]) == ""
    assert detok.update(unicorn_ids[-1:]) == "🦄"


def test_matches_tokenizers_decode_stream(chatml):
    """tokenizers' own DecodeStream, step by step, is a second oracle."""
    rng = random.Random(7)
    backend = chatml._backend
    for _ in range(20):
        ids = chatml.encode(_random_text(rng), add_special_tokens=False)
        stream, detok = DecodeStream(skip_special_tokens=True), IncrementalDetokenizer(chatml, [])
        for token_id in ids:
            assert detok.update([token_id]) == (stream.step(backend, token_id) or "")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_byte_level(chatml, skip_special_tokens):
    """Any id sequence, invalid UTF-8 and special tokens included: deltas + flush == decode."""
    rng = random.Random(1234)
    for trial in range(150):
        prompt = chatml.encode(_random_text(rng, rng.randint(0, 12))) if trial % 3 else []
        ids = [rng.randrange(chatml.vocab_size) for _ in range(rng.randint(1, 40))]
        expected = chatml.decode(ids, skip_special_tokens=skip_special_tokens)
        detok = IncrementalDetokenizer(chatml, prompt, skip_special_tokens=skip_special_tokens)
        assert _stream(detok, ids, rng, check_prefix_of=expected) == expected


def _random_valid_pieces(tok, rng, n_units):
    """Ids that decode to whole characters overall, but split them across tokens: ordinary
    tokens, special tokens and the <0xNN> byte-fallback tokens of multi-byte characters."""
    vocab = [t for t, i in sorted(tok._backend.get_vocab().items(), key=lambda kv: kv[1])]
    ordinary = [tok.token_to_id(t) for t in vocab if not t.startswith("<")]
    specials = [tok.token_to_id(t) for t in ("<s>", "</s>")]
    ids = []
    for _ in range(n_units):
        kind = rng.random()
        if kind < 0.5:
            ids.append(rng.choice(ordinary))
        elif kind < 0.6:
            ids.append(rng.choice(specials))
        else:
            char = rng.choice(MULTIBYTE_CHARS)
            ids.extend(tok.token_to_id(f"<0x{b:02X}>") for b in char.encode("utf-8"))
    return ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_byte_fallback_sequences(llama, skip_special_tokens):
    rng = random.Random(99)
    for trial in range(150):
        ids = _random_valid_pieces(llama, rng, rng.randint(1, 25))
        prompt = llama.encode(_random_text(rng, 10)) if trial % 2 else []
        # SentencePiece drops a text's first leading space; the output's first token is
        # not the text's start when a prompt precedes it, so the oracle decodes both.
        prompt_text = llama.decode(prompt, skip_special_tokens=skip_special_tokens)
        full_text = llama.decode(prompt + ids, skip_special_tokens=skip_special_tokens)
        assert full_text.startswith(prompt_text)
        expected = full_text[len(prompt_text) :]
        detok = IncrementalDetokenizer(llama, prompt, skip_special_tokens=skip_special_tokens)
        streamed = _stream(detok, ids, rng, check_prefix_of=expected)
        assert streamed == expected
        assert REPLACEMENT not in streamed


def test_leading_space_of_first_output_token_is_kept_after_a_prompt(llama):
    prompt = llama.encode("Hello")
    ids = llama.encode("world", add_special_tokens=False)  # starts with '▁world'
    assert llama.decode(ids) == "world"  # alone, the decoder strips the space
    detok = IncrementalDetokenizer(llama, prompt)
    assert "".join(detok.update([i]) for i in ids) == " world"


def test_spaces_between_special_tokens(chatml):
    rng = random.Random(5)
    specials = sorted(chatml.all_special_ids)
    for _ in range(50):
        ids = [
            rng.choice(specials) if rng.random() < 0.3 else rng.randrange(chatml.vocab_size)
            for _ in range(rng.randint(1, 30))
        ]
        for skip in (True, False):
            expected = chatml.decode(ids, skip, spaces_between_special_tokens=True)
            detok = IncrementalDetokenizer(chatml, [], skip, spaces_between_special_tokens=True)
            assert _stream(detok, ids, rng, check_prefix_of=expected) == expected


class _WindowRecordingTokenizer(Tokenizer):
    """Records the longest id list any decode call gets."""

    def __init__(self, inner: Tokenizer):
        self.__dict__.update(inner.__dict__)
        self.longest_decode = 0

    def decode(self, ids, *args, **kwargs):
        self.longest_decode = max(self.longest_decode, len(ids))
        return super().decode(ids, *args, **kwargs)


def test_work_per_update_does_not_grow_with_output_length(chatml):
    recording = _WindowRecordingTokenizer(chatml)
    text = "".join(tf.CORPUS) * 2
    ids = chatml.encode(text, add_special_tokens=False)
    assert len(ids) > 2000
    end = chatml.token_to_id("<|im_end|>")
    ids = [token for i, t in enumerate(ids) for token in ((t, end) if i % 50 == 0 else (t,))]
    ids[1000:1000] = [end] * 500  # a long run of skipped tokens must not widen the window
    detok = IncrementalDetokenizer(recording, chatml.encode("prompt " * 100))
    streamed = "".join(detok.update([token_id]) for token_id in ids)
    assert streamed == text
    # A few tokens (a split character plus its left context), not thousands.
    assert recording.longest_decode <= 24
    assert len(detok._ids) <= 24
    assert detok.num_output_tokens == len(ids)


def test_flush_releases_an_unfinished_character(chatml):
    ids = chatml.encode("ok你", add_special_tokens=False)
    detok = IncrementalDetokenizer(chatml, [])
    streamed = detok.update(ids[:-1])
    assert REPLACEMENT not in streamed
    assert streamed + detok.flush() == chatml.decode(ids[:-1])
    assert detok.flush() == ""
