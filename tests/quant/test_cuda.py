"""Every format's torch code gives the same bits on CUDA as on the CPU."""

from __future__ import annotations

import pytest
import torch

from freetoken.quant import FORMATS, get_format

pytestmark = pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_quantize_and_dequantize_on_cuda_match_cpu(name):
    fmt = get_format(name)
    x = torch.randn(4, 8, 512, generator=torch.Generator().manual_seed(0))
    cpu = fmt.quantize(x)
    gpu = fmt.quantize(x.cuda())
    assert torch.equal(gpu.data.cpu().view(torch.uint8), cpu.data.view(torch.uint8))
    for k, v in cpu.scales.items():
        assert torch.equal(gpu.scales[k].cpu().view(torch.uint8), v.view(torch.uint8)), k
    assert torch.equal(fmt.dequantize(gpu).cpu(), fmt.dequantize(cpu))
