"""Q8_0x8 (Q8_0 regrouped eight blocks at a time) against the gguf package's Q8_0
dequantisation of the bytes it was regrouped from."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from freetoken.quant import QuantTensor, dequantize_as, get_format
from freetoken.quant.q8_0x8 import regroup, regroups
from tests.quant.test_gguf_blocks import random_blocks


@pytest.mark.parametrize("shape", [(3, 512), (2, 3, 768)])
def test_regrouped_blocks_hold_the_files_weights(shape):
    raw = random_blocks("q8_0", shape, seed=sum(shape))
    want = dequantize(raw, GGMLQuantizationType.Q8_0).reshape(shape)
    qt = QuantTensor("q8_0x8", shape, regroup(torch.from_numpy(raw)))
    assert qt.data.shape == raw.shape  # the same bytes per row, moved
    fmt = get_format("q8_0x8")
    np.testing.assert_array_equal(fmt.dequantize(qt).numpy(), want)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_as(qt, dtype), torch.from_numpy(want).to(dtype))


def test_rows_regroup_in_whole_groups_only():
    assert regroups(768) and regroups(2048) and not regroups(2880)
    with pytest.raises(ValueError, match="block size 256"):
        get_format("q8_0x8").quantize(torch.randn(2, 96))
