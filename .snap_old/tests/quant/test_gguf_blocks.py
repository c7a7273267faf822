"""GGUF block formats against the gguf package's numpy reference, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from freetoken.quant import QuantTensor, get_format

T = GGMLQuantizationType
# format -> (GGML type, byte offsets of the block's f16 fields)
BLOCK_FORMATS: dict[str, tuple[GGMLQuantizationType, tuple[int, ...]]] = {
    "q8_0": (T.Q8_0, (0,)),
    "q4_0": (T.Q4_0, (0,)),
    "q5_0": (T.Q5_0, (0,)),
    "q4_k": (T.Q4_K, (0, 2)),
    "q5_k": (T.Q5_K, (0, 2)),
    "q6_k": (T.Q6_K, (208,)),
    "mxfp4": (T.MXFP4, ()),
}
GGUF_QUANTIZABLE = ["q8_0", "q4_0", "q5_0", "mxfp4"]
SHAPES = [(3, 512), (2, 3, 256)]  # 2-D weights and 3-D (experts, rows, cols) banks


def random_blocks(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random bytes whose f16 fields are finite values spanning many binades (and zero)."""
    qtype, f16_offsets = BLOCK_FORMATS[name]
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    n_blocks = int(np.prod(shape)) // block_size
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for off in f16_offsets:
        scale = rng.choice([-1.0, 1.0], n_blocks) * 2.0 ** rng.uniform(-24, 8, n_blocks)
        scale[0] = 0.0
        blocks[:, off : off + 2] = scale.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(*shape[:-1], -1)


def random_weights(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Gaussian rows of very different magnitudes, one all-zero block, one lone spike."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x *= (10.0 ** rng.uniform(-4, 2, (*shape[:-1], 1))).astype(np.float32)
    x.reshape(-1)[:32] = 0.0
    x.reshape(-1)[40] = 1e3
    return x


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")  # e8m0 255 times 6 is inf in both
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", list(BLOCK_FORMATS))
def test_dequantize_matches_gguf(name: str, shape: tuple[int, ...]) -> None:
    fmt = get_format(name)
    raw = random_blocks(name, shape, seed=len(shape))
    t = QuantTensor(name, shape, torch.from_numpy(raw))
    ours = fmt.dequantize(t)
    ref = torch.from_numpy(gguf_dequantize(raw, BLOCK_FORMATS[name][0]))
    assert ours.dtype == torch.float32 and tuple(ours.shape) == shape
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", GGUF_QUANTIZABLE)
def test_quantize_matches_gguf(name: str, shape: tuple[int, ...]) -> None:
    x = random_weights(shape, seed=7)
    q = get_format(name).quantize(torch.from_numpy(x))
    ref = gguf_quantize(x, BLOCK_FORMATS[name][0])
    assert q.fmt == name and q.shape == shape
    assert np.array_equal(q.data.numpy(), ref)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["q4_k", "q5_k", "q6_k"])
def test_k_quant_round_trip(name: str, shape: tuple[int, ...]) -> None:
    # gguf cannot quantise k-quants; ours must still produce blocks gguf reads as we do.
    x = random_weights(shape, seed=3)
    fmt = get_format(name)
    q = fmt.quantize(torch.from_numpy(x))
    back = fmt.dequantize(q)
    ref = gguf_dequantize(q.data.numpy(), BLOCK_FORMATS[name][0])
    assert torch.equal(back, torch.from_numpy(ref))
    # error within a few quantisation steps of each 256-weight super-block's range
    xb = torch.from_numpy(x).reshape(-1, 256)
    err = (back.reshape(-1, 256) - xb).abs().amax(-1)
    levels = {"q4_k": 15, "q5_k": 31, "q6_k": 63}[name]
    assert torch.all(err <= 2 * xb.abs().amax(-1) / levels + 1e-30)


@pytest.mark.parametrize(("name", "max_rel_rms"),
                         [("q4_k", 0.09), ("q5_k", 0.045), ("q6_k", 0.025)])
def test_k_quant_accuracy(name: str, max_rel_rms: float) -> None:
    x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(0)) * 0.02
    fmt = get_format(name)
    back = fmt.dequantize(fmt.quantize(x))
    assert (back - x).norm() / x.norm() < max_rel_rms


@pytest.mark.parametrize("name", list(BLOCK_FORMATS))
def test_sizes_match_ggml(name: str) -> None:
    fmt = get_format(name)
    qtype = BLOCK_FORMATS[name][0]
    assert fmt.gguf_type == qtype
    assert (fmt.block_size, fmt.block_bytes) == GGML_QUANT_SIZES[qtype]


@pytest.mark.parametrize(
    ("name", "cols", "row_bytes"),
    [
        ("q8_0", 32, 34),
        ("q8_0", 4096, 4352),
        ("q4_0", 32, 18),
        ("q5_0", 32, 22),
        ("q4_k", 256, 144),
        ("q4_k", 2048, 1152),
        ("q5_k", 256, 176),
        ("q5_k", 2048, 1408),
        ("q6_k", 256, 210),
        ("mxfp4", 32, 17),
        ("mxfp4", 2880, 1530),
    ],
)
def test_row_bytes(name: str, cols: int, row_bytes: int) -> None:
    assert get_format(name).row_bytes(cols) == row_bytes


def test_bad_shapes_are_rejected() -> None:
    fmt = get_format("q4_k")
    with pytest.raises(ValueError, match="not a multiple of the block size 256"):
        fmt.row_bytes(100)
    wrong = QuantTensor("q4_k", (2, 256), torch.zeros(2, 100, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"expected uint8 data of shape \(2, 144\)"):
        fmt.dequantize(wrong)
