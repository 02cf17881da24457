"""Tokenizer: text <-> ids, the raw bytes of every token, chat templates, streaming decode.

Token ids are encoded by the `tokenizers` library (the same code transformers uses), but
decoding here works on *bytes*: every id maps to the exact bytes it stands for
(`token_bytes`). That is what constraint controllers need (313 SmolLM2 tokens are partial
UTF-8 sequences, so no `str` per token exists), and it makes streaming simple: bytes go into
an incremental UTF-8 decoder that holds back an incomplete character until it is completed.
"""

from __future__ import annotations

import codecs
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Iterable

import numpy as np

# The tokenizers library's own thread pool: off. Tokenizing runs on the calling thread, so a
# controller's `tokenize` import is counted in its thread's CPU time (its deadline), and a
# tokenization never spreads over cores the model is using. (Set before the library first runs.)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

__all__ = ["ChatTemplateError", "StreamDecoder", "Tokenizer", "byte_to_unicode"]

# Special tokens that end a turn or a document in common vocabularies; when they exist as
# special tokens they stop generation too, besides the configured EOS.
_STOP_TOKEN_NAMES = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "</s>", "<end_of_turn>")

# The plain ChatML layout, used by the built-in test tokenizer (SmolLM2's own template adds
# a default system prompt, which would only make tiny tests slower).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """No chat template, or the template rejected the messages (raise_exception)."""


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies.

    Bytes that are printable Latin-1 characters stand for themselves; the other 68
    (control characters, space, 0x7f-0xa0, 0xad) are shifted to code points 256 and up,
    in byte order, so that every vocabulary string is printable.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


@lru_cache(maxsize=1)
def _unicode_to_latin1() -> dict[int, str]:
    """str.translate table: byte-level character -> the Latin-1 character of its byte, so
    that `piece.translate(t).encode("latin-1")` yields the raw bytes (fast, done in C)."""
    return {ord(c): chr(b) for b, c in byte_to_unicode().items()}


def _json_types(node) -> set[str]:
    """All `"type"` values in a (nested) serialized tokenizers component."""
    found: set[str] = set()
    if isinstance(node, dict):
        if isinstance(node.get("type"), str):
            found.add(node["type"])
        for v in node.values():
            found |= _json_types(v)
    elif isinstance(node, list):
        for v in node:
            found |= _json_types(v)
    return found


def _decoder_style(tok) -> tuple[str, bool]:
    """How vocabulary strings map to bytes: ("byte_level" | "sentencepiece" | "plain",
    strip_leading_space). Read from the decoder, which is what defines text for an id."""
    decoder = tok.decoder
    if decoder is None:
        return "plain", False
    spec = json.loads(decoder.__getstate__())
    types = _json_types(spec)
    if "ByteLevel" in types:
        return "byte_level", False
    if types & {"ByteFallback", "Metaspace"} or "▁" in json.dumps(spec, ensure_ascii=False):
        # SentencePiece decoders drop the space that `▁` adds before the first word.
        strip = "Strip" in types or (
            "Metaspace" in types and spec.get("prepend_scheme", "always") != "never"
            and spec.get("add_prefix_space", True)
        )
        return "sentencepiece", bool(strip)
    return "plain", False


def _piece_bytes(piece: str, style: str) -> bytes:
    if style == "byte_level":
        try:
            return piece.translate(_unicode_to_latin1()).encode("latin-1")
        except UnicodeEncodeError:  # not a byte-level string (shouldn't happen): take it literally
            return piece.encode("utf-8")
    if style == "sentencepiece":
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])  # byte-fallback token
            except ValueError:
                pass
        return piece.replace("▁", " ").encode("utf-8")
    return piece.encode("utf-8")


def _token_name(value) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what generation needs: ids of special/stop tokens, the
    raw bytes of every id, a chat template and a byte-exact streaming decoder."""

    def __init__(self, hf_tokenizer, *, eos_token_id: int | None, bos_token_id: int | None = None,
                 chat_template: str | None = None, extra_stop_ids: Iterable[int] = (),
                 vocab_size: int | None = None):
        self._tok = hf_tokenizer
        vocab = hf_tokenizer.get_vocab(with_added_tokens=True)
        added = hf_tokenizer.get_added_tokens_decoder()  # id -> AddedToken
        known = max(vocab.values(), default=-1) + 1
        #: Number of token ids (including ids past the tokenizer's own, when `vocab_size`
        #: pads it to a model's embedding size; those decode to nothing).
        self.vocab_size = max(known, vocab_size or 0)
        self.special_token_ids = frozenset(i for i, t in added.items() if t.special)
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        stops = {i for i in extra_stop_ids if 0 <= i < self.vocab_size}
        if eos_token_id is not None:
            stops.add(eos_token_id)
        stops |= {vocab[n] for n in _STOP_TOKEN_NAMES if n in vocab and vocab[n] in self.special_token_ids}
        self.stop_token_ids = frozenset(stops)

        style, self._strip_leading_space = _decoder_style(hf_tokenizer)
        table = [b""] * self.vocab_size
        for piece, i in vocab.items():
            # Added tokens are stored as their literal text, not in the vocabulary encoding.
            table[i] = added[i].content.encode("utf-8") if i in added else _piece_bytes(piece, style)
        self._token_bytes = table
        # Same table with special tokens emptied, for skip_special_tokens decoding.
        self._token_bytes_plain = [b"" if i in self.special_token_ids else b for i, b in enumerate(table)]
        self._packed: tuple[np.ndarray, np.ndarray] | None = None
        self._template = None

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_folder(cls, path: str | Path, vocab_size: int | None = None) -> "Tokenizer":
        """Load `tokenizer.json` plus settings from tokenizer_config.json, and (when
        present) special_tokens_map.json, generation_config.json and chat_template.jinja."""
        from tokenizers import Tokenizer as HFTokenizer

        folder = Path(path)
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        tok = HFTokenizer.from_file(str(tj))
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        generation = _read_json(folder / "generation_config.json")

        def token_id(key: str) -> int | None:
            name = _token_name(config.get(key)) or _token_name(special_map.get(key))
            return tok.token_to_id(name) if name is not None else None

        gen_eos = generation.get("eos_token_id")
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else [i for i in gen_eos or [] if isinstance(i, int)]
        eos = token_id("eos_token")
        if eos is None and gen_eos:
            eos = gen_eos[0]
        bos = token_id("bos_token")
        if bos is None and isinstance(generation.get("bos_token_id"), int):
            bos = generation["bos_token_id"]

        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not template and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        if not template:
            template = _read_json(folder / "chat_template.json").get("chat_template")
        return cls(tok, eos_token_id=eos, bos_token_id=bos, chat_template=template or None,
                   extra_stop_ids=gen_eos, vocab_size=vocab_size)

    @classmethod
    def byte_level(cls, vocab_size: int = 512) -> "Tokenizer":
        """A tiny tokenizer built in code, for tests with the tiny random model.

        Ids 0-2 are `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (special, like SmolLM2),
        ids 3..258 are the 256 bytes; no merges, so any text encodes to one token per byte.
        Ids from 259 to `vocab_size - 1` exist only to match the model's embedding size.
        """
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        if vocab_size < len(specials) + 256:
            raise ValueError(f"vocab_size must be at least {len(specials) + 256}")
        vocab = {name: i for i, name in enumerate(specials)}
        vocab.update({ch: len(specials) + b for b, ch in byte_to_unicode().items()})
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
        return cls(tok, eos_token_id=2, bos_token_id=1, chat_template=CHATML_TEMPLATE,
                   vocab_size=vocab_size)

    # ------------------------------------------------------------------ ids <-> text

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids for `text`. Special-token text in `text` (e.g. "<|im_end|>") becomes
        the special id, as in transformers; `add_special_tokens` adds the tokenizer's
        post-processor tokens (e.g. a BOS), if it has any."""
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # e.g. a lone surrogate from JSON "\ud800": not encodable text
            if isinstance(text, str):
                raise ValueError("text is not valid Unicode (it contains a lone surrogate)") from None
            raise

    def encode_without_gil(self, text: str) -> list[int]:
        """`encode(text)`, letting go of the GIL while the tokenizer works on this thread (other
        Python threads run meanwhile); for texts tokenized off the main path (a controller's import)."""
        try:
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        except TypeError:
            raise ValueError("text is not valid Unicode (it contains a lone surrogate)") from None

    def _bytes_of(self, ids: Iterable[int], skip_special_tokens: bool) -> bytes:
        table = self._token_bytes_plain if skip_special_tokens else self._token_bytes
        n = self.vocab_size
        out = []
        for i in ids:
            if not 0 <= i < n:
                raise ValueError(f"token id {i} is outside the vocabulary (0..{n - 1})")
            out.append(table[i])
        return b"".join(out)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`: their bytes joined, decoded as UTF-8 with U+FFFD for invalid parts.

        Exactly the concatenation of a `stream_decoder()`'s output for the same ids.
        """
        text = self._bytes_of(ids, skip_special_tokens).decode("utf-8", errors="replace")
        if self._strip_leading_space and text.startswith(" "):
            text = text[1:]
        return text

    @property
    def token_bytes(self) -> list[bytes]:
        """Raw bytes of every id (`len == vocab_size`); special tokens give their text.
        Shared: do not modify."""
        return self._token_bytes

    def token_bytes_packed(self) -> tuple[np.ndarray, np.ndarray]:
        """`(data uint8, offsets uint32)`: token i is `data[offsets[i]:offsets[i+1]]`.

        Built once and cached; both arrays are read-only because they are shared.
        """
        if self._packed is None:
            lengths = np.fromiter(map(len, self._token_bytes), dtype=np.int64, count=self.vocab_size)
            offsets = np.zeros(self.vocab_size + 1, dtype=np.uint32)
            np.cumsum(lengths, out=offsets[1:])
            data = np.frombuffer(b"".join(self._token_bytes), dtype=np.uint8)  # read-only view
            offsets.setflags(write=False)
            self._packed = (data, offsets)
        return self._packed

    def stream_decoder(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        table = self._token_bytes_plain if skip_special_tokens else self._token_bytes
        return StreamDecoder(table, strip_leading_space=self._strip_leading_space)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render `messages` with the model's Jinja chat template (sandboxed: templates come
        with downloaded models and must not reach Python internals)."""
        if not self.chat_template:
            raise ChatTemplateError("this tokenizer has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        bos = self._token_bytes[self.bos_token_id].decode("utf-8") if self.bos_token_id is not None else ""
        eos = self._token_bytes[self.eos_token_id].decode("utf-8") if self.eos_token_id is not None else ""
        context = {"bos_token": bos, "eos_token": eos, **kwargs}
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)


def _compile_template(source: str):
    """Compile like transformers does: trimmed blocks, loop controls, `tojson`, and a
    `raise_exception` helper that templates call to reject bad conversations."""
    import jinja2.ext
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ChatTemplateError(f"chat template refused the messages: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ChatTemplateError(f"invalid chat template: {exc}") from exc


class StreamDecoder:
    """Turns a stream of token ids into text deltas without ever splitting a character.

    Bytes go through Python's incremental UTF-8 decoder, which holds back a trailing
    incomplete (but still possibly valid) sequence and emits U+FFFD at once for bytes that
    can never become valid. So each `push` costs O(bytes of the new tokens), and the
    concatenated deltas equal `Tokenizer.decode(all ids)` once `flush()` has been called.

    `pop(n)` forgets the last n tokens (the engine may backtrack). After every token we keep
    a checkpoint (characters emitted so far, decoder state); popping restores the checkpoint
    and tells the caller how many characters it must delete from what it already printed.
    """

    def __init__(self, token_bytes: list[bytes], strip_leading_space: bool = False):
        self._table = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip = strip_leading_space
        self._emitted = 0  # characters handed out so far
        self._started = False  # has any character been produced (for strip_leading_space)
        # _marks[k] = state after k tokens: (chars emitted, decoder state, started)
        self._marks: list[tuple[int, tuple[bytes, int], bool]] = [(0, self._decoder.getstate(), False)]

    def __len__(self) -> int:
        """Number of tokens pushed and not popped."""
        return len(self._marks) - 1

    def _text(self, data: bytes, final: bool = False) -> str:
        text = self._decoder.decode(data, final)
        if text and not self._started:
            self._started = True
            if self._strip and text[0] == " ":
                text = text[1:]
        self._emitted += len(text)
        return text

    def push(self, ids: Iterable[int]) -> str:
        """Add tokens; return the newly completed text (possibly "")."""
        table, n = self._table, len(self._table)
        parts = []
        for i in ids:
            if not 0 <= i < n:
                raise ValueError(f"token id {i} is outside the vocabulary (0..{n - 1})")
            parts.append(self._text(table[i]))
            self._marks.append((self._emitted, self._decoder.getstate(), self._started))
        return "".join(parts)

    def flush(self) -> str:
        """Emit bytes still held back (an unfinished character becomes U+FFFD)."""
        text = self._text(b"", final=True)
        # Fold the flushed characters into the latest checkpoint, so pop() accounts for them.
        self._marks[-1] = (self._emitted, self._decoder.getstate(), self._started)
        return text

    def pop(self, n: int) -> int:
        """Forget the last `n` tokens; return how many already-emitted characters to delete."""
        if not 0 <= n <= len(self):
            raise ValueError(f"cannot pop {n} tokens, only {len(self)} pushed")
        if n == 0:
            return 0
        del self._marks[len(self._marks) - n:]
        chars, state, started = self._marks[-1]
        removed = self._emitted - chars
        self._emitted, self._started = chars, started
        self._decoder.setstate(state)
        return removed
