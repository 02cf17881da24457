"""Tokenizer tests: the built-in byte-level tokenizer (fast), SentencePiece-style byte
mapping, streaming decode, chat templates, and the real SmolLM2 tokenizer (marked `model`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rudder.tokenizer import ChatTemplateError, StreamDecoder, Tokenizer, byte_to_unicode

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Texts that trip tokenizers: digit splitting, code indentation, emoji (4-byte UTF-8 that
# SmolLM2 splits across tokens), CJK, leading/trailing spaces, newlines, ChatML markers.
TRICKY_TEXTS = [
    "12345",
    "The year 2024 had 366 days; 3.14159 and -0.5e10.",
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f(3))",
    "emoji: 😀👍🏽 🇫🇷 family 👨‍👩‍👧",
    "中文字符和日本語のテキスト、한국어",
    "   leading spaces and trailing   ",
    "\n\nnewlines\r\n\r\nand\ttabs\n",
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "naïve café Ünïcödé — “quotes” …",
    "",
]


def _feed_one_by_one(dec: StreamDecoder, ids: list[int]) -> list[str]:
    deltas = [dec.push([i]) for i in ids]
    deltas.append(dec.flush())
    return deltas


# ----------------------------------------------------------------------------- byte map


def test_byte_to_unicode_matches_tokenizers_alphabet():
    from tokenizers import pre_tokenizers

    mapping = byte_to_unicode()
    assert sorted(mapping) == list(range(256))
    assert set(mapping.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert mapping[ord(" ")] == "Ġ" and mapping[ord("\n")] == "Ċ" and mapping[ord("a")] == "a"


# ----------------------------------------------------------------------------- tiny tokenizer


def test_byte_level_ids_and_specials(tiny_tokenizer):
    tok = tiny_tokenizer
    assert tok.vocab_size == 512
    assert [tok.encode(s) for s in SPECIALS] == [[0], [1], [2]]
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1
    assert tok.stop_token_ids == {0, 2}
    assert tok.special_token_ids == {0, 1, 2}
    assert tok.token_bytes[:3] == [s.encode() for s in SPECIALS]
    assert tok.token_bytes[3:259] == [bytes([b]) for b in range(256)]
    assert tok.token_bytes[259:] == [b""] * (512 - 259)  # padding ids decode to nothing
    assert tok.encode("Hi é") == [3 + b for b in "Hi é".encode()]


def test_byte_level_rejects_too_small_vocab():
    with pytest.raises(ValueError):
        Tokenizer.byte_level(vocab_size=100)


@given(st.text())
def test_byte_level_round_trips_any_text(text):
    tok = Tokenizer.byte_level()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert b"".join(tok.token_bytes[i] for i in ids) == text.encode()


@given(st.binary())
def test_decode_of_arbitrary_bytes_uses_replacement(data):
    tok = Tokenizer.byte_level()
    ids = [3 + b for b in data]
    assert tok.decode(ids) == data.decode("utf-8", errors="replace")


def test_encode_rejects_lone_surrogates(tiny_tokenizer):
    with pytest.raises(ValueError, match="surrogate"):
        tiny_tokenizer.encode("a\ud800b")


def test_decode_skip_special_and_range_check(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert tok.decode(ids) == "<|im_start|>hi<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "hi"
    for bad in (-1, 512):
        with pytest.raises(ValueError):
            tok.decode([bad])


def test_token_bytes_packed(tiny_tokenizer):
    data, offsets = tiny_tokenizer.token_bytes_packed()
    assert data.dtype == np.uint8 and offsets.dtype == np.uint32
    assert len(offsets) == tiny_tokenizer.vocab_size + 1
    for i, b in enumerate(tiny_tokenizer.token_bytes):
        assert data[offsets[i]:offsets[i + 1]].tobytes() == b
    assert tiny_tokenizer.token_bytes_packed()[0] is data  # cached
    assert not data.flags.writeable and not offsets.flags.writeable


# ----------------------------------------------------------------------------- streaming


@settings(max_examples=200)
@given(st.text(), st.randoms(use_true_random=False))
def test_stream_never_splits_a_character(text, rnd):
    tok = Tokenizer.byte_level()
    ids = tok.encode(text)
    dec = tok.stream_decoder()
    deltas = []
    pos = 0
    while pos < len(ids):  # random chunk sizes, including one token at a time
        step = rnd.randint(1, 4)
        deltas.append(dec.push(ids[pos:pos + step]))
        pos += step
    deltas.append(dec.flush())
    for d in deltas:
        # the input is valid UTF-8: no partial character leaked as U+FFFD (unless the text has one)
        assert d.count("\ufffd") <= text.count("\ufffd")
        d.encode("utf-8")  # and every delta is a well-formed string
    assert "".join(deltas) == tok.decode(ids) == text


@given(st.binary())
def test_stream_matches_decode_on_invalid_bytes(data):
    tok = Tokenizer.byte_level()
    ids = [3 + b for b in data]
    assert "".join(_feed_one_by_one(tok.stream_decoder(), ids)) == tok.decode(ids)


def test_stream_holds_partial_character(tiny_tokenizer):
    dec = tiny_tokenizer.stream_decoder()
    euro = [3 + b for b in "€".encode()]  # three bytes
    assert dec.push(euro[:1]) == ""
    assert dec.push(euro[1:2]) == ""
    assert dec.push(euro[2:]) == "€"
    assert dec.push([3 + 0xE2]) == ""
    assert dec.flush() == "\ufffd"  # an unfinished character is replaced only at the end


def test_stream_skip_special(tiny_tokenizer):
    dec = tiny_tokenizer.stream_decoder(skip_special_tokens=True)
    assert dec.push(tiny_tokenizer.encode("<|im_start|>ok<|im_end|>")) == "ok"


@settings(max_examples=200)
@given(st.lists(st.one_of(st.tuples(st.just("push"), st.text(max_size=6)),
                          st.tuples(st.just("pop"), st.integers(0, 8)))))
def test_stream_pop_keeps_output_consistent(ops):
    """After any push/pop sequence the printed text (deltas appended, popped characters
    deleted) equals what a fresh decoder prints for the surviving tokens."""
    tok = Tokenizer.byte_level()
    dec = tok.stream_decoder()
    ids: list[int] = []
    shown = ""
    for op, arg in ops:
        if op == "push":
            new = tok.encode(arg)
            ids += new
            shown += dec.push(new)
        else:
            n = min(arg, len(ids))
            removed = dec.pop(n)
            assert 0 <= removed <= len(shown)
            shown = shown[: len(shown) - removed]
            del ids[len(ids) - n:]
        assert len(dec) == len(ids)
    fresh = tok.stream_decoder()
    assert shown == fresh.push(ids)
    assert shown + dec.flush() == tok.decode(ids)


def test_stream_pop_partial_character(tiny_tokenizer):
    tok = tiny_tokenizer
    dec = tok.stream_decoder()
    assert dec.push(tok.encode("a")) == "a"
    emoji = tok.encode("😀")
    assert dec.push(emoji[:2]) == ""
    assert dec.pop(1) == 0  # nothing of the emoji was shown yet
    assert dec.push(emoji[1:]) == "😀"
    assert len(dec) == 5
    assert dec.pop(2) == 1  # the emoji was shown: delete it; its first two bytes are pending again
    assert dec.push(tok.encode("b")) == "\ufffdb"  # ... and become invalid when "b" follows
    assert dec.pop(3) == 2  # back to just "a"
    assert dec.push(tok.encode("c")) == "c"
    with pytest.raises(ValueError):
        dec.pop(5)


def test_stream_pop_after_flush(tiny_tokenizer):
    dec = tiny_tokenizer.stream_decoder()
    dec.push([3 + ord("x"), 3 + 0xF0])
    assert dec.flush() == "\ufffd"
    assert dec.pop(1) == 1  # the flushed replacement character goes with its token
    assert dec.push([3 + ord("y")]) == "y"


# ----------------------------------------------------------------------------- chat templates


def test_chat_template_chatml(tiny_tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tiny_tokenizer.apply_chat_template(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not tiny_tokenizer.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant\n")


def test_chat_template_errors(tiny_tokenizer):
    from jinja2.exceptions import SecurityError

    tok = tiny_tokenizer
    tok.chat_template = "{{ raise_exception('no system role') }}"
    tok._template = None
    with pytest.raises(ChatTemplateError, match="no system role"):
        tok.apply_chat_template([])
    tok.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    tok._template = None
    with pytest.raises(SecurityError):  # templates come with downloaded models: sandboxed
        tok.apply_chat_template([])
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


# ----------------------------------------------------------------------------- from_folder


def test_from_folder_reads_hf_settings(tmp_path, tiny_tokenizer):
    tiny_tokenizer._tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        # HF writes special tokens either as plain strings or as AddedToken dicts.
        "eos_token": {"content": "<|im_end|>", "special": True},
        "chat_template": [{"name": "default", "template": "{{ messages[0]['content'] }}!"}],
    }))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|im_start|>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_folder(tmp_path)
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1
    assert tok.stop_token_ids == {0, 2}
    assert tok.vocab_size == 259  # the file knows 259 ids; padding is the caller's choice
    assert Tokenizer.from_folder(tmp_path, vocab_size=512).vocab_size == 512
    assert tok.apply_chat_template([{"role": "user", "content": "yo"}]) == "yo!"


def test_from_folder_chat_template_file_and_missing(tmp_path, tiny_tokenizer):
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_folder(tmp_path)
    tiny_tokenizer._tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text("T")
    tok = Tokenizer.from_folder(tmp_path)
    assert tok.apply_chat_template([]) == "T"
    assert tok.eos_token_id is None  # nothing configured it


def _sentencepiece_tokenizer() -> Tokenizer:
    """A Llama-2-style vocabulary: `▁` marks spaces, `<0xNN>` tokens are byte fallbacks."""
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "h", "i", "▁h", "▁hi", "é", "▁é"]
    vocab = {p: i for i, p in enumerate(pieces)}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[("▁", "h"), ("▁h", "i"), ("▁", "é")],
                                byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return Tokenizer(hf, eos_token_id=2, bos_token_id=1)


def test_sentencepiece_token_bytes():
    tok = _sentencepiece_tokenizer()
    vocab = tok._tok.get_vocab()
    assert tok.token_bytes[vocab["<0x0A>"]] == b"\n"
    assert tok.token_bytes[vocab["▁hi"]] == b" hi"
    assert tok.token_bytes[vocab["▁é"]] == " é".encode()
    assert tok.token_bytes[vocab["</s>"]] == b"</s>"
    for text in ["hi hi", "hi\nhé 😀", " hi"]:
        ids = tok.encode(text)
        # Same text as the tokenizers library's own decoder (which strips the leading space).
        assert tok.decode(ids) == tok._tok.decode(ids, skip_special_tokens=False)
        assert "".join(_feed_one_by_one(tok.stream_decoder(), ids)) == tok.decode(ids)


# ----------------------------------------------------------------------------- real SmolLM2


@pytest.fixture(scope="module")
def hf_reference_tokenizer(smollm2_gguf_dir):
    """transformers' own tokenizer for the same GGUF (built offline from its metadata)."""
    import transformers  # the `test` extra: missing, the test errors (never skips)

    folder, name = smollm2_gguf_dir
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.mark.model
def test_smollm2_ids_match_transformers(smollm2_tokenizer, hf_reference_tokenizer):
    for text in TRICKY_TEXTS:
        want = hf_reference_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert smollm2_tokenizer.encode(text) == want, text


@pytest.mark.model
def test_smollm2_decode_matches_transformers(smollm2_tokenizer, hf_reference_tokenizer):
    import random

    rng = random.Random(1234)
    for _ in range(300):  # random ids include partial UTF-8 tokens, specials, everything
        ids = [rng.randrange(smollm2_tokenizer.vocab_size) for _ in range(rng.randrange(1, 12))]
        want = hf_reference_tokenizer.decode(ids, skip_special_tokens=False,
                                             clean_up_tokenization_spaces=False)
        assert smollm2_tokenizer.decode(ids) == want, ids


@pytest.mark.model
def test_smollm2_basics(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.stop_token_ids == {0, 2}  # <|im_end|> and <|endoftext|>
    assert tok.special_token_ids == set(range(17))
    assert tok.encode("12345") == tok.encode("1") + tok.encode("2") + tok.encode("3") + tok.encode("4") + tok.encode("5")


@pytest.mark.model
def test_smollm2_token_bytes(smollm2_tokenizer):
    tok = smollm2_tokenizer
    for text in TRICKY_TEXTS:
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes[i] for i in ids) == text.encode(), text
    partial = 0
    for b in tok.token_bytes:
        try:
            b.decode("utf-8")
        except UnicodeDecodeError:
            partial += 1
    assert partial == 313  # tokens that are not whole UTF-8: detokenize on bytes
    data, offsets = tok.token_bytes_packed()
    assert int(offsets[-1]) == len(data) == sum(map(len, tok.token_bytes))


@pytest.mark.model
@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.sampled_from("ab 1\n😀中é👍🏽") | st.characters(codec="utf-8"), max_size=40))
def test_smollm2_stream_never_splits(smollm2_tokenizer, text):
    tok = smollm2_tokenizer
    ids = tok.encode(text)
    # Byte values absent from the vocabulary are dropped by the encoder (see FACTS.md).
    expected = tok.decode(ids)
    deltas = _feed_one_by_one(tok.stream_decoder(), ids)
    if "\ufffd" not in expected:
        assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == expected


@pytest.mark.model
def test_smollm2_chat_template(smollm2_tokenizer):
    out = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert out.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert out.startswith("<|im_start|>system\n")  # SmolLM2's template adds a default system turn
    with_system = smollm2_tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], add_generation_prompt=False)
    assert with_system == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
