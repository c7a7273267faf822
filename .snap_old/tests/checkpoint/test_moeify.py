"""moeify's output read back by the ``gguf`` package: each expert is the dense MLP with its
intermediate neurons reordered (one order per expert for gate, up and down), and everything
else is the source file's.

The source is read with our reader (its bytes as stored); the output with ``gguf.GGUFReader``
and dequantised with ``gguf.quants.dequantize``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from freetoken.checkpoint import default_model_path
from freetoken.checkpoint.gguf import GGUFCheckpoint
from freetoken.checkpoint.moeify import moeify_gguf
from freetoken.quant import QuantTensor, get_format

E, TOP_K = 4, 2


@pytest.fixture(scope="module")
def source() -> GGUFCheckpoint:
    return GGUFCheckpoint(default_model_path())


@pytest.fixture(scope="module")
def moe_path(source: GGUFCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("moeify") / "moe.gguf"
    return moeify_gguf(source.path, path, E, TOP_K, seed=0)


@pytest.fixture(scope="module")
def moe(moe_path: Path) -> GGUFReader:
    return GGUFReader(moe_path)


def test_experts_are_the_dense_mlp_reordered(source: GGUFCheckpoint, moe: GGUFReader):
    stored = dict(source.stored_tensors())
    out = {t.name: t for t in moe.tensors}
    cfg = source.config
    H, I_ = cfg.hidden_size, cfg.intermediate_size
    for layer in range(cfg.num_layers):
        blk = f"blk.{layer}"
        assert not {f"{blk}.ffn_{p}.weight" for p in ("gate", "up", "down")} & out.keys()
        gate, up, down = (_dense(stored[f"{blk}.ffn_{p}.weight"]) for p in ("gate", "up", "down"))
        gates, ups, downs = (_read(out[f"{blk}.ffn_{p}_exps.weight"])
                             for p in ("gate", "up", "down"))
        assert gates.shape == ups.shape == (E, I_, H) and downs.shape == (E, H, I_)
        router = out[f"{blk}.ffn_gate_inp.weight"]
        assert router.tensor_type == GGMLQuantizationType.F32 and _read(router).shape == (E, H)
        row_of = {row.tobytes(): i for i, row in enumerate(gate)}
        assert len(row_of) == I_  # distinct rows: each expert row names one dense neuron
        orders = []
        for e in range(E):
            order = np.array([row_of[row.tobytes()] for row in gates[e]])
            assert sorted(order) == list(range(I_)), f"layer {layer} expert {e}"
            np.testing.assert_array_equal(ups[e], up[order])
            np.testing.assert_array_equal(downs[e], down[:, order])
            orders.append(tuple(order))
        assert len(set(orders)) == E and tuple(range(I_)) not in orders[1:]


def test_everything_else_is_copied(source: GGUFCheckpoint, moe: GGUFReader):
    out = {t.name: t for t in moe.tensors}
    for name, t in source.stored_tensors():
        if ".ffn_gate." in name or ".ffn_up." in name or ".ffn_down." in name:
            continue
        got = out[name]
        assert got.tensor_type == get_format(t.fmt).gguf_type, name
        assert got.data.tobytes() == t.data.contiguous().numpy().tobytes(), name
    fields = moe.fields
    for key, value in source.metadata.items():
        if key.startswith("_"):
            continue
        field = fields[key]
        if field.types[0] == GGUFValueType.ARRAY and field.types[-1] != GGUFValueType.STRING:
            assert np.array_equal(np.concatenate([field.parts[i] for i in field.data]), value)
        else:
            assert field.contents() == value, key
    arch = "gemma3"
    assert fields[f"{arch}.expert_count"].contents() == E
    assert fields[f"{arch}.expert_used_count"].contents() == TOP_K
    for key in ("expert_feed_forward_length", "feed_forward_length"):
        assert fields[f"{arch}.{key}"].contents() == source.config.intermediate_size
    assert fields[f"{arch}.expert_weights_norm"].contents() is True


def test_the_moe_config(moe_path: Path):
    cfg = GGUFCheckpoint(moe_path).config
    assert (cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size) == (E, TOP_K, 2048)
    assert cfg.norm_topk_prob and all(cfg.moe_layers) and cfg.family == "gemma3"


def _dense(t: QuantTensor) -> np.ndarray:
    """A source tensor dequantised by the ``gguf`` package."""
    gguf_type = get_format(t.fmt).gguf_type
    assert gguf_type is not None
    return dequantize(t.data.contiguous().numpy().view(np.uint8), GGMLQuantizationType(gguf_type))


def _read(t: ReaderTensor) -> np.ndarray:
    """An output tensor as the ``gguf`` package reads and dequantises it."""
    return dequantize(t.data, t.tensor_type)
