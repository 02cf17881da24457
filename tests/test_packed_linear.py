"""The linear layers of each precision (rudder/packed_linear.py): oneDNN-packed fp32 and the native
bf16 / int8 kinds compute F.linear's numbers (of their rounded weights), with rows that do not
depend on their batch, fused epilogues (residual add, SwiGLU) equal to the unfused ops, and a whole
model that still computes what it did."""

import copy
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rudder.config import TINY_CONFIG
from rudder.engine.model_runner import StepArrays
from rudder.model import build_model
from rudder import kernels
from rudder.packed_linear import (Bf16Linear, Int8Linear, Linear, PackedLinear, pack_blocks, pack_linears,
                                  packing_available, place_in_huge_pages, unpack_blocks, unpack_linears)

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(bias):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 96, generator=gen) / 10
    b = torch.randn(300, generator=gen) if bias else None
    layer = PackedLinear(w, b)
    for rows in (1, 7, 64, 129):
        x = torch.randn(rows, 96, generator=gen)
        assert torch.allclose(layer(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert torch.equal(layer.weight, w)  # the packed weight unpacks exactly


def test_a_row_does_not_depend_on_its_batch():
    gen = torch.Generator().manual_seed(1)
    layer = PackedLinear(torch.randn(512, 128, generator=gen))
    x = torch.randn(40, 128, generator=gen)
    full = layer(x)
    for i in (0, 17, 39):
        assert torch.equal(layer(x[i:i + 1])[0], full[i])
        assert torch.equal(layer(x[i:i + 5])[0], full[i])


@pytest.mark.parametrize("kind", [Bf16Linear, Int8Linear])
@pytest.mark.parametrize("swiglu", [False, True])
def test_a_native_row_does_not_depend_on_its_batch(kind, swiglu):
    """70 rows (with AMX: pairs of 16-row tiles, then a tile alone; without: passes of a few rows)
    against each row alone and in other slices, bit for bit, for the plain product, the SwiGLU
    epilogue and the residual add."""
    gen = torch.Generator().manual_seed(2)
    layer = kind(torch.randn(200, 96, generator=gen) / 10, swiglu=swiglu)
    x = torch.randn(70, 96, generator=gen).to(torch.bfloat16)
    run = layer.swiglu if swiglu else layer
    full = run(x)
    for i, n in ((0, 1), (17, 1), (33, 1), (69, 1), (5, 40), (30, 33)):
        assert torch.equal(run(x[i:i + n]), full[i:i + n]), (i, n)
    if not swiglu:
        base = torch.randn(70, 200, generator=gen).to(torch.bfloat16)
        added = layer.add_into(x, base.clone())
        for i in (0, 40, 69):
            assert torch.equal(layer.add_into(x[i:i + 1], base[i:i + 1].clone()), added[i:i + 1])


def _forward(model, cfg):
    arrays = StepArrays(np.array([5]), np.array([0]), np.arange(5), np.array([[0, 1]]), np.array([4]),
                        np.array([3, 1, 4, 1, 5]))
    ids, positions, meta, rows = arrays.tensors(4, "cpu")
    kv = torch.zeros(cfg.num_layers, 2, 2, 4, cfg.num_kv_heads, cfg.head_dim)
    return model.logits(model(ids, positions, meta, kv).index_select(0, rows))


def test_a_packed_model_computes_what_it_did_and_unpacks():
    plain = build_model(TINY_CONFIG, None)
    expected = _forward(plain, TINY_CONFIG)
    packed = pack_linears(build_model(TINY_CONFIG, None))
    assert not any(type(m) is nn.Linear for m in packed.modules())
    assert isinstance(packed.lm_head, PackedLinear)  # the tied head has a packed copy of the embeddings
    assert torch.allclose(_forward(packed, TINY_CONFIG), expected, atol=1e-4)
    assert torch.allclose(_forward(copy.deepcopy(packed), TINY_CONFIG), expected, atol=1e-4)
    back = unpack_linears(packed)
    assert not any(isinstance(m, PackedLinear) for m in back.modules())
    qkv = back.layers[0].self_attn.qkv_proj
    assert type(qkv) is nn.Linear and torch.equal(qkv.weight, plain.layers[0].self_attn.qkv_proj.weight)


def test_only_the_last_pipeline_stage_gets_a_head():
    from rudder.pipeline import partition
    from rudder.pipeline.stage_model import build_stage_model

    first, last = (build_stage_model("tiny:4", stage) for stage in partition(4, 2))
    assert first.lm_head is None and isinstance(last.lm_head, Linear)


def test_other_dtypes_are_left_alone():
    model = unpack_linears(build_model(TINY_CONFIG, None)).to(torch.float64)
    pack_linears(model)
    assert not any(isinstance(m, Linear) for m in model.modules())


native = pytest.mark.skipif("not kernels.available()", reason="no native kernels")  # evaluated at set-up, not collection


@pytest.mark.parametrize("per_lane, n, k", [(2, 40, 64), (2, 33, 48)])
def test_block_packing_round_trips(per_lane, n, k):
    w = torch.randn(n, k)
    packed = pack_blocks(w, per_lane)
    assert packed.shape == ((n + 15) // 16, k // per_lane, 16, per_lane)
    assert torch.equal(unpack_blocks(packed, n), w)
    both = pack_blocks(torch.cat([w, 2 * w]), per_lane, swiglu=True)
    assert torch.equal(unpack_blocks(both, 2 * n, swiglu=True), torch.cat([w, 2 * w]))


@native
@pytest.mark.parametrize("kind", [Bf16Linear, Int8Linear])
@pytest.mark.parametrize("n, k", [(300, 96), (40, 64), (17, 36)])
def test_native_layers_compute_f_linear_of_their_weights(kind, n, k):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(n, k, generator=gen) / 10
    layer = kind(w, out_dtype=torch.float32)
    rel = (layer.weight - w).norm() / w.norm()
    assert rel < (0.004 if kind is Bf16Linear else 0.01)  # what rounding the weights costs
    x = torch.randn(37, k, generator=gen).bfloat16()
    full = layer(x)
    ref = F.linear(x.float(), layer.weight)
    # bf16: fp32 sums of exact products; int8: x is taken at 16 bits against each row's largest value
    assert (full - ref).norm() / ref.norm() < (1e-6 if kind is Bf16Linear else 1e-4)
    for rows in (1, 2, 3, 5, 16, 17):  # a row's result is the same whatever else the call holds
        assert torch.equal(layer(x[:rows]), full[:rows])
    assert torch.equal(copy.deepcopy(layer)(x), full)


@native
@pytest.mark.parametrize("kind", [Bf16Linear, Int8Linear])
def test_native_epilogues_equal_the_unfused_ops(kind):
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(2 * 40, 64, generator=gen) / 8
    x = torch.randn(6, 64, generator=gen).bfloat16()
    tol = 1e-5 if kind is Bf16Linear else 1e-3
    gate_up = kind(w, out_dtype=torch.float32, swiglu=True)
    y = F.linear(x.float(), gate_up.weight)
    torch.testing.assert_close(gate_up.swiglu(x), F.silu(y[:, :40]) * y[:, 40:], atol=tol, rtol=tol)
    torch.testing.assert_close(gate_up(x), y, atol=tol, rtol=tol)
    down = kind(w[:40], out_dtype=torch.float32)
    residual = torch.randn(6, 40, generator=gen)
    expected = residual + F.linear(x.float(), down.weight)
    out = down.add_into(x, residual)
    assert out is residual  # in place: the residual stream is updated, not copied
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address`."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(a, 16) for a in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif("not kernels.available()", reason="no native kernels")
@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"), reason="no THP here")
def test_native_weights_move_into_huge_pages_and_compute_the_same():
    gen = torch.Generator().manual_seed(2)
    layers = nn.Sequential(*[Bf16Linear(torch.randn(1024, 512, generator=gen) / 20) for _ in range(3)],
                           Int8Linear(torch.randn(1024, 512, generator=gen) / 20))
    x = torch.randn(3, 512, generator=gen).to(torch.bfloat16)
    before = [layer(x) for layer in layers]
    assert place_in_huge_pages(layers) >= 3 * 1024 * 512 * 2 + 1024 * 512
    assert place_in_huge_pages(layers) == 0  # placed once
    for layer, want in zip(layers, before):
        assert layer.in_huge_pages and torch.equal(layer(x), want)
        assert "hg" in _vm_flags(layer.packed.data_ptr())  # advised for huge pages
