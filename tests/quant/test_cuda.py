"""Every format's torch code gives the same bits on CUDA as on the CPU."""

from __future__ import annotations

import pytest
import torch

from freetoken.quant import FORMATS, get_format

pytestmark = pytest.mark.cuda
GGUF_FORMATS = ["bf16", "f16", "q8_0", "q4_0", "q5_0", "q4_k", "q6_k", "mxfp4"]


@pytest.mark.parametrize("name", GGUF_FORMATS)
def test_quantize_and_dequantize_on_cuda_match_cpu(name):
    assert name in FORMATS
    fmt = get_format(name)
    x = torch.randn(4, 8, 512, generator=torch.Generator().manual_seed(0))
    cpu = fmt.quantize(x)
    gpu = fmt.quantize(x.cuda())
    assert torch.equal(gpu.data.cpu().view(torch.uint8), cpu.data.view(torch.uint8))
    assert torch.equal(fmt.dequantize(gpu).cpu(), fmt.dequantize(cpu))
