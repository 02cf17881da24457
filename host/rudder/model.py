"""A Llama-family decoder in plain PyTorch, attending over a paged KV cache.

One forward call takes a *ragged* batch: the new tokens of every scheduled sequence, laid out
back to back (`[T]`), whatever their count per sequence (a prefill chunk, one decode token,
several fast-forwarded tokens). Linear layers run on the flat `[T, hidden]` rows with no
padding; only attention regroups the rows per sequence, through index tensors that the model
runner builds once per step (`AttentionMetadata`) and every layer reuses.

Checkpoints use Hugging Face Llama names (`layers.0.self_attn.q_proj.weight`, ...); q/k/v and gate/up
are fused into one matmul each at load (`fuse_projections`). RoPE uses
the rotate-half convention (the GGUF loader un-permutes llama.cpp's Q/K rows for this).

Precision (`build_model(..., dtype=)`, rudder/precision.py): the weights are loaded in fp32 and
the linear layers swapped for the precision's kind (packed_linear.py); embeddings, norms,
activations and the KV cache take the activation dtype (`model.act_dtype`).

A layer costs 8 calls: RMSNorm, the fused QKV projection, attention, the output projection with
the residual add as its epilogue, RMSNorm, gate/up with SiLU and the product fused, and the down
projection with the residual add. On the CPU, attention is one native call per layer
(native/attention.c: RoPE, the KV write and attention over the paged cache in place, for any
number of new tokens per sequence); elsewhere it runs as torch ops that gather each sequence's
context (`Attention.torch_attention`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .config import ModelConfig
from .engine.kv_cache import block_size_of, is_paired, read_blocks, write_slots
from .packed_linear import Bf16Linear, Int8Linear, Linear, prepare_linears
from .precision import activation_dtype, resolve


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the KV cache and which keys each query may see.

    B sequences, T new tokens in all; Q = the longest run of new tokens of one sequence,
    K = the longest context (cached + new) rounded up to whole blocks.
    """

    slot_mapping: torch.Tensor  # [T] int64: flat KV slot (block * block_size + offset) of each new token
    query_gather: torch.Tensor  # [B*Q] int64: row of the flat batch for each padded query (T = a zero row)
    query_scatter: torch.Tensor  # [T] int64: padded query index of each flat row
    block_tables: torch.Tensor  # [B, K / block_size] int64: cache blocks of each sequence, in order
    attn_mask: torch.Tensor  # [B, 1, Q, K] bool: True where the query may attend the key
    batch: int
    max_query: int
    native: kernels.AttentionStep | None = None  # set by the model's forward when it uses the native kernel


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch runs a bf16 rms_norm as ~8 ops; one native pass instead (any precision other
        # than fp32, where torch's own kernel is fused and fast)
        if x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous() and kernels.available(x.device):
            return kernels.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(cfg: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    angles = torch.outer(torch.arange(cfg.max_position, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h, hd, kvh = cfg.num_heads, cfg.head_dim, cfg.num_kv_heads
        # q, k and v projections fused into one matmul (one pass over x, one bigger GEMM).
        self.qkv_proj = nn.Linear(cfg.hidden_size, (h + 2 * kvh) * hd, bias=cfg.attention_bias)
        self.splits = (h * hd, kvh * hd, kvh * hd)
        self.o_proj = nn.Linear(h * hd, cfg.hidden_size, bias=False)
        self.scale = 1.0 / math.sqrt(hd)

    def attend(self, x, cos, sin, meta: AttentionMetadata, k_cache, v_cache) -> torch.Tensor:
        """The attention output before o_proj, [T, heads * head_dim] (the new tokens' keys and
        values go into the cache on the way)."""
        qkv = self.qkv_proj(x)
        if meta.native is not None:
            return kernels.attention(meta.native, qkv, k_cache, v_cache)
        return self.torch_attention(qkv, cos, sin, meta, k_cache, v_cache)

    def forward(self, x, cos, sin, meta: AttentionMetadata, k_cache, v_cache):
        return self.o_proj(self.attend(x, cos, sin, meta, k_cache, v_cache))

    def torch_attention(self, qkv, cos, sin, meta: AttentionMetadata, k_cache, v_cache) -> torch.Tensor:
        cfg = self.cfg
        T, dtype = qkv.shape[0], qkv.dtype
        q, k, v = qkv.split(self.splits, dim=-1)
        # RoPE in fp32; keys and values are stored at the activations' precision, whatever the
        # cache's dtype, so that a cache of another dtype holds the same values.
        q = apply_rope(q.view(T, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rope(k.view(T, cfg.num_kv_heads, cfg.head_dim), cos, sin).to(dtype)
        v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)

        # Write the new keys/values into their cache slots, then read each sequence's whole
        # context back through its block table (the new tokens included).
        kv_dtype = k_cache.dtype
        write_slots(k_cache, v_cache, meta.slot_mapping, k.to(kv_dtype), v.to(kv_dtype))
        B, Q = meta.batch, meta.max_query
        keys, values = read_blocks(k_cache, v_cache, meta.block_tables.view(-1), cfg.head_dim)
        keys = keys.view(B, -1, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        values = values.view(B, -1, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)

        q = q.to(kv_dtype)
        if Q == 1 and B == T:  # pure decode: one query per sequence, already in order
            queries = q.view(B, 1, cfg.num_heads, cfg.head_dim)
        else:
            padded = torch.cat([q, q.new_zeros(1, cfg.num_heads, cfg.head_dim)])
            queries = padded.index_select(0, meta.query_gather).view(B, Q, cfg.num_heads, cfg.head_dim)
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys, values, attn_mask=meta.attn_mask, scale=self.scale, enable_gqa=True
        )  # [B, heads, Q, head_dim]
        out = out.transpose(1, 2).reshape(B * Q, cfg.num_heads * cfg.head_dim)
        if not (Q == 1 and B == T):
            out = out.index_select(0, meta.query_scatter)
        return out.to(dtype)


def _add_into(layer, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + layer(x), as the layer's fused epilogue when it has one."""
    return layer.add_into(x, residual) if isinstance(layer, Linear) else residual + layer(x)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # gate and up projections fused into one matmul.
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def act(self, x):
        """silu(gate) * up."""
        if isinstance(self.gate_up_proj, Linear):
            return self.gate_up_proj.swiglu(x)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(self, x):
        return self.down_proj(self.act(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, meta, k_cache, v_cache):
        """x: the residual stream [T, hidden] (may be updated in place); returns the new one."""
        attn = self.self_attn.attend(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache)
        x = _add_into(self.self_attn.o_proj, attn, x)
        return _add_into(self.mlp.down_proj, self.mlp.act(self.post_attention_layernorm(x)), x)


def run_layers(model: nn.Module, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               kv_cache: torch.Tensor) -> torch.Tensor:
    """`model.layers` over the residual stream x (the model's or a pipeline stage's): the
    native attention kernel's step is set up once for all layers; the RoPE rows are gathered
    only for the torch path."""
    cfg = model.cfg
    cos = sin = None
    meta.native = None
    if (kernels.available(x.device) and cfg.head_dim % 16 == 0 and cfg.num_heads % cfg.num_kv_heads == 0
            and kv_cache.is_contiguous() and kv_cache.dtype in (torch.float32, torch.bfloat16)
            and x.dtype in (torch.float32, torch.bfloat16)):
        seq_of = meta.query_scatter if meta.max_query == 1 else torch.div(meta.query_scatter, meta.max_query,
                                                                            rounding_mode="floor")
        meta.native = kernels.AttentionStep(positions, meta.slot_mapping, seq_of, meta.block_tables,
                                            block_size_of(kv_cache, cfg.head_dim), model.rope_cos, model.rope_sin,
                                            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, x.dtype, kv_cache.dtype,
                                            1.0 / math.sqrt(cfg.head_dim), paired=is_paired(kv_cache[0, 0]))
    else:
        cos = model.rope_cos.index_select(0, positions).unsqueeze(1)
        sin = model.rope_sin.index_select(0, positions).unsqueeze(1)
    stack = native_stack(model) if meta.native is not None and x.dtype == torch.bfloat16 else None
    if stack is not None:  # every layer in one native call (native/decoder.c): the same kernels
        x = x.contiguous()
        stack.run(meta.native, x, kv_cache)
    else:
        for i, layer in enumerate(model.layers):
            x = layer(x, cos, sin, meta, kv_cache[i, 0], kv_cache[i, 1])
    meta.native = None
    return x


def native_stack(model: nn.Module) -> kernels.DecoderStack | None:
    """The model's layers for native/decoder.c, built on first use (None when a layer is not
    made of native bf16 / int8 kernels: fp32, other devices, no native library). A model's
    layers must not be swapped after its first forward pass."""
    if getattr(model, "native_stack_of", None) is model.layers:
        return model.native_stack
    model.native_stack = None
    model.__dict__["native_stack_of"] = model.layers  # (a plain attribute, not a second registered submodule)
    eps, specs = None, []
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        linears = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if (not all(isinstance(lin, Bf16Linear | Int8Linear) and lin.out_dtype == torch.bfloat16 for lin in linears)
                or not m.gate_up_proj.swiglu_layout or any(lin.bias is not None for lin in linears[1:])
                or any(n.weight.dtype != torch.bfloat16 or n.eps != norms[0].eps for n in norms)
                or eps not in (None, norms[0].eps)):
            return None
        eps = norms[0].eps
        dense = [(lin.packed, lin.scales, lin.sums, lin.bias, lin.out_features) for lin in linears]
        dense[2] = dense[2][:4] + (m.gate_up_proj.out_features // 2,)
        specs.append((norms[0].weight, norms[1].weight, *dense))
    if specs:
        model.native_stack = kernels.DecoderStack(specs, model.cfg.hidden_size, eps)
    return model.native_stack


def embedding(vocab_size: int, hidden_size: int) -> nn.Embedding:
    """An embedding table without its random init. Models are built on the meta device and filled
    afterwards; nn.Embedding's normal_ init on meta runs through torch._refs, which imports
    torch._dynamo: 1.3 s of every process start, spent on numbers that are thrown away."""
    return nn.Embedding(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size))


def materialize(module: nn.Module, device: torch.device | str) -> nn.Module:
    """`module.to_empty(device=...)`, without its detour: to_empty's empty_like on meta tensors
    runs through torch._refs, which imports sympy (0.3 s of every process start)."""
    for mod in module.modules():
        for name, p in mod.named_parameters(recurse=False):
            mod._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                 requires_grad=p.requires_grad)
        for name, b in mod.named_buffers(recurse=False):
            mod._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    return module


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and the LM head (a pipeline stage builds its own slice:
    rudder.pipeline.stage_model)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # RoPE tables [max_position, head_dim], filled by build_model on the model's device.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.precision, self.act_dtype = "fp32", torch.float32  # set_precision changes them

    @torch.inference_mode()
    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]. kv_cache: [layers, 2, blocks, block_size, kv_heads, head_dim].
        Returns the final hidden states [T, hidden] (normalised; feed rows to `logits`)."""
        return self.norm(run_layers(self, self.embed_tokens(input_ids), positions, meta, kv_cache))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab] of normalised hidden states."""
        if self.lm_head is None:
            return F.linear(hidden.to(self.embed_tokens.weight.dtype), self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights (without the `model.` prefix); fails on anything missing."""
        fused = fuse_projections(state_dict, self.cfg)
        expected = set(self.state_dict())
        missing = expected - fused.keys()
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        # assign=True adopts the checkpoint tensors (memory-mapped where not fused) without a copy.
        device = self.embed_tokens.weight.device
        self.load_state_dict({k: fused[k].to(device=device, dtype=torch.float32) for k in expected},
                             strict=True, assign=True)


def fuse_projections(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF's separate q/k/v and gate/up tensors, concatenated into our fused ones."""
    out = dict(state_dict)
    for i in range(cfg.num_layers):
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        for kind in ("weight", "bias"):
            parts = [f"{a}{p}_proj.{kind}" for p in "qkv"]
            if all(p in out for p in parts):
                out[f"{a}qkv_proj.{kind}"] = torch.cat([out.pop(p) for p in parts])
        parts = [f"{m}gate_proj.weight", f"{m}up_proj.weight"]
        if all(p in out for p in parts):
            out[f"{m}gate_up_proj.weight"] = torch.cat([out.pop(p) for p in parts])
    return out


def set_precision(model: nn.Module, precision: str) -> nn.Module:
    """Turn an fp32 model (a LlamaModel or a pipeline stage) into one of `precision` ("fp32",
    "bf16", "int8"; rudder/precision.py), in place: its linear layers (and a tied LM head of its
    own) become that precision's kind, embeddings and norms take the activation dtype."""
    device = model.rope_cos.device
    model.precision, model.act_dtype = precision, activation_dtype(precision, device)
    prepare_linears(model, precision)  # first: an int8 head is quantised from the fp32 embeddings
    for module in model.modules():
        if isinstance(module, (nn.Embedding, RMSNorm)):
            module.weight.data = module.weight.data.to(model.act_dtype)
    return model


def build_model(cfg: ModelConfig, state_dict: dict[str, torch.Tensor] | None = None,
                device: torch.device | str = "cpu", seed: int = 0, dtype: str = "fp32") -> LlamaModel:
    """The model with the given weights, or random ones (the tiny test model) when None, in
    precision `dtype` ("auto", "fp32", "bf16" or "int8")."""
    return set_precision(_fp32_model(cfg, state_dict, device, seed), resolve(dtype, device))


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """The random fp32 weights `build_model(cfg, None, seed=seed)` has (fused names)."""
    return _fp32_model(cfg, None, "cpu", seed).state_dict()


def _fp32_model(cfg: ModelConfig, state_dict, device, seed: int) -> LlamaModel:
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model = materialize(model, device)
    cos, sin = rope_tables(cfg, torch.device(device))
    model.rope_cos, model.rope_sin = cos, sin
    if state_dict is None:
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.data.fill_(1.0)
            elif p.dim() == 1:
                p.data.zero_()
            else:
                p.data.copy_(torch.randn(p.shape, generator=gen) * (1.0 / math.sqrt(p.shape[-1])))
    else:
        model.load_weights(state_dict)
    return model.eval().requires_grad_(False)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder needs (prefix-free names) and its shape."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
    }
    if cfg.attention_bias:
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                      "self_attn.v_proj.bias": (kv,)})
    shapes = {"embed_tokens.weight": (cfg.vocab_size, h), "norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        shapes.update({f"layers.{i}.{k}": s for k, s in layer.items()})
    return shapes
