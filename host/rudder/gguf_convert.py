"""Convert a llama-architecture GGUF file into a Hugging Face-style model folder.

Why convert at all: `gguf.GGUFReader` needs seconds just to open a file and dequantizing
takes seconds more, while an fp32 safetensors file loads in milliseconds via mmap. So we
pay once and keep the result: `config.json`, `model.safetensors` (HF Llama tensor names),
`tokenizer.json` and `tokenizer_config.json`, then a completion marker written last.

Two things are easy to get silently wrong here:
- RoPE: llama.cpp's converter permutes the rows of `attn_q`/`attn_k` so that rotation pairs
  are adjacent (2i, 2i+1). HF code rotates halves (i, i + head_dim/2), so we undo that
  permutation; otherwise the model still babbles plausible English with wrong logits.
- The tokenizer: the GGUF holds a byte-level BPE vocabulary and merges but not the
  pre-tokenizer; for `tokenizer.ggml.pre == "smollm"` it is digits-one-by-one followed by
  GPT-2's byte-level split.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import numpy as np

from rudder.config import ModelConfig
from rudder.errors import ModelLoadError
from rudder.fsutil import atomic_path, clear_marker, write_json_atomic, write_marker

# Bump when the output of the conversion changes, so that old cache folders are redone.
CONVERTER_VERSION = 1

# GGUF token types (llama.cpp's `llama_token_type`).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# GGUF per-layer tensor name -> HF name inside `model.layers.{i}.`.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")


# --------------------------------------------------------------------------- metadata


def _field_value(field):
    """Decode a GGUF metadata field into Python values without relying on newer `gguf`
    helpers (`ReaderField.contents` is recent): strings, numbers, bools and arrays of them."""
    import gguf

    types = field.types
    if not types:
        return None

    def scalar(idx, vtype):
        part = field.parts[idx]
        if vtype == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        value = part[0].item()
        return bool(value) if vtype == gguf.GGUFValueType.BOOL else value

    if types[0] == gguf.GGUFValueType.ARRAY:
        return [scalar(idx, types[-1]) for idx in field.data]
    return scalar(field.data[0], types[0])


def _meta(reader, key, default=...):
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ModelLoadError(f"GGUF file lacks the metadata key {key!r}")
        return default
    return _field_value(field)


def _f32_clean(x: float) -> float:
    # GGUF stores floats as float32 (1e-5 comes back as 9.99999974e-06); keep the shortest
    # decimal that rounds to the same float32 so config.json reads like the original.
    return float(str(np.float32(x)))


def config_from_gguf(reader) -> ModelConfig:
    """Architecture hyper-parameters from the GGUF metadata (llama architecture only)."""
    arch = _meta(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported (only 'llama' GGUFs can be converted)"
        )
    p = f"{arch}."
    heads = int(_meta(reader, p + "attention.head_count"))
    hidden = int(_meta(reader, p + "embedding_length"))
    head_dim = int(_meta(reader, p + "attention.key_length", 0) or hidden // heads)
    rope_dims = int(_meta(reader, p + "rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelLoadError(f"partial rotary embeddings ({rope_dims} of {head_dim}) are not supported")
    scaling = _meta(reader, p + "rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ModelLoadError(f"RoPE scaling {scaling!r} is not supported")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else int(_meta(reader, p + "vocab_size"))
    names = {t.name for t in reader.tensors}
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_meta(reader, p + "feed_forward_length")),
        num_layers=int(_meta(reader, p + "block_count")),
        num_heads=heads,
        num_kv_heads=int(_meta(reader, p + "attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=_f32_clean(_meta(reader, p + "rope.freq_base", 10000.0)),
        rms_norm_eps=_f32_clean(_meta(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(_meta(reader, p + "context_length", 2048)),
        # llama.cpp omits `output.weight` when the LM head shares the embedding matrix.
        tie_word_embeddings="output.weight" not in names,
        attention_bias=False,
    )


# --------------------------------------------------------------------------- weights


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (adjacent-pair rotation -> HF rotate_half).

    llama.cpp did `w.reshape(n, 2, hd//2, in).swapaxes(1, 2)`: within each head, row j of
    the first half and row j of the second half became rows 2j and 2j+1. This is the inverse.
    """
    rows = w.shape[0]
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} is not supported by rudder's converter")


def state_dict_from_gguf(reader, cfg: ModelConfig, progress: bool = False) -> dict[str, np.ndarray]:
    """Dequantize every tensor to fp32 (HF layout and names, Q/K un-permuted)."""
    from gguf.quants import dequantize
    from tqdm import tqdm

    from rudder.model import expected_shapes

    # The loader's list of tensors and shapes, under their on-disk (`model.`-prefixed) names.
    expected = {(k if k == "lm_head.weight" else "model." + k): s for k, s in expected_shapes(cfg).items()}
    out: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc="rudder: dequantizing", unit="tensor",
                  file=sys.stderr, disable=not progress):
        name = _hf_name(t.name)
        # dequantize returns numpy (rows, cols) = (out_features, in_features) = nn.Linear.
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if name.endswith("q_proj.weight"):
            w = unpermute_rope(w, cfg.num_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope(w, cfg.num_kv_heads)
        want = expected.get(name)
        if want is None or tuple(w.shape) != want:
            raise ModelLoadError(f"GGUF tensor {t.name!r} has shape {tuple(w.shape)}, expected {want}")
        out[name] = np.ascontiguousarray(w)
    missing = sorted(set(expected) - set(out))
    if missing:
        raise ModelLoadError(f"GGUF file lacks {len(missing)} tensors, e.g. {missing[0]!r}")
    return out


# --------------------------------------------------------------------------- tokenizer


def tokenizer_from_gguf(reader):
    """Rebuild the HF fast tokenizer (and tokenizer_config.json contents) from GGUF metadata.

    Returns `(tokenizers.Tokenizer, tokenizer_config: dict)`.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = _meta(reader, "tokenizer.ggml.model")
    pre = _meta(reader, "tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    # Only pre-tokenizers we have verified against transformers; a wrong split would give
    # different token ids without any error, so refuse rather than guess.
    if pre == "smollm":
        pre_tok = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre in ("default", "gpt-2"):
        pre_tok = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        raise ModelLoadError(f"GGUF pre-tokenizer {pre!r} is not supported (known: smollm, gpt-2)")

    tokens: list[str] = _meta(reader, "tokenizer.ggml.tokens")
    types: list[int] = _meta(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges_raw: list[str] = _meta(reader, "tokenizer.ggml.merges")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelLoadError("GGUF vocabulary has duplicate tokens")
    merges = []
    for m in merges_raw:
        parts = m.split(" ")
        if len(parts) != 2:
            raise ModelLoadError(f"malformed BPE merge {m!r} in GGUF")
        merges.append((parts[0], parts[1]))

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|> ...) must be matched whole in the input and be special;
    # user-defined ones are matched whole but decode as ordinary text.
    added = [
        AddedToken(tokens[i], special=types[i] == _TOKEN_CONTROL, normalized=False)
        for i in range(len(tokens))
        if types[i] in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]
    # Both calls keep the existing ids since these tokens are already in the vocabulary.
    tok.add_special_tokens([t for t in added if t.special])
    tok.add_tokens([t for t in added if not t.special])
    for t in added:
        if t.content not in vocab or tok.token_to_id(t.content) != vocab[t.content]:
            raise ModelLoadError(f"added token {t.content!r} did not keep its id")

    def token_at(key):
        idx = _meta(reader, key, None)
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    eos = token_at("tokenizer.ggml.eos_token_id")
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_at("tokenizer.ggml.bos_token_id"),
        "eos_token": eos,
        "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_at("tokenizer.ggml.padding_token_id") or eos,
        "add_bos_token": bool(_meta(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_meta(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_meta(reader, "llama.context_length", 2048)),
    }
    template = _meta(reader, "tokenizer.chat_template", None)
    if template:
        tok_config["chat_template"] = template
    return tok, tok_config


# --------------------------------------------------------------------------- driver


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"rudder: {msg}", file=sys.stderr, flush=True)


def convert_gguf(gguf_file: Path, out_dir: Path, *, progress: bool = False,
                 marker_info: dict | None = None) -> ModelConfig:
    """Convert `gguf_file` into the HF-style folder `out_dir` and mark it complete.

    Every file is written atomically and the marker last, so an interrupted conversion
    leaves a folder that `read_marker` reports incomplete and that the next call redoes.
    """
    import gguf
    from safetensors.numpy import save_file

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    clear_marker(out_dir)

    t0 = time.perf_counter()
    _say(progress, f"reading {gguf_file.name} (takes a few seconds, once)")
    try:
        reader = gguf.GGUFReader(gguf_file)
    except Exception as exc:  # gguf raises bare ValueError/struct errors on bad files
        raise ModelLoadError(f"cannot read GGUF file {gguf_file}: {exc}") from exc
    cfg = config_from_gguf(reader)

    _say(progress, "building tokenizer")
    tok, tok_config = tokenizer_from_gguf(reader)
    with atomic_path(out_dir / "tokenizer.json") as tmp:
        tok.save(str(tmp))
    write_json_atomic(out_dir / "tokenizer_config.json", tok_config)

    tensors = state_dict_from_gguf(reader, cfg, progress=progress)
    _say(progress, "writing model.safetensors")
    with atomic_path(out_dir / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    del tensors

    hf = cfg.to_hf_dict()
    vocab = tok.get_vocab(with_added_tokens=True)
    for key in ("bos_token", "eos_token", "pad_token"):
        if tok_config.get(key) in vocab:
            hf[f"{key}_id"] = vocab[tok_config[key]]
    write_json_atomic(out_dir / "config.json", hf)

    write_marker(out_dir, {"converter_version": CONVERTER_VERSION, "source": gguf_file.name,
                           **(marker_info or {})})
    _say(progress, f"converted in {time.perf_counter() - t0:.1f} s -> {out_dir}")
    return cfg
