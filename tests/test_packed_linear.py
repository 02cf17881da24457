"""oneDNN-packed linear layers (rudder/packed_linear.py): the same numbers as F.linear, rows that
do not depend on their batch, and a whole model that still computes what it did."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rudder.config import TINY_CONFIG
from rudder.engine.model_runner import StepArrays
from rudder.model import build_model
from rudder.packed_linear import PackedLinear, pack_linears, packing_available, unpack_linears

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
    assert first.lm_head is None and isinstance(last.lm_head, PackedLinear)


def test_other_dtypes_are_left_alone():
    model = build_model(TINY_CONFIG, None).to(torch.float64)
    pack_linears(model)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
