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
    assert torch.equal(_bytes(gpu.data), _bytes(cpu.data))
    for k, v in cpu.scales.items():
        assert torch.equal(_bytes(gpu.scales[k]), _bytes(v)), k
    assert torch.equal(fmt.dequantize(gpu).cpu(), fmt.dequantize(cpu))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
