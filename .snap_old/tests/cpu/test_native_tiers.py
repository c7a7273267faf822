"""Every vector width of the engine thread's native steps (decode attention, RMSNorm, rotary,
the MLP's gated activation).

The library compiles them once per width and the CPU picks its widest at load time, so the
other widths never run on a test machine. Here each width is built on its own (FT_ONE_TIER,
the production flags of that width) into a small library and checked against torch.
"""

from __future__ import annotations

import ctypes as c
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import Rotary

CSRC = Path(__file__).resolve().parents[2] / "csrc"
# width: (what target_clones builds it with, the CPU flag it needs)
TIERS = {"default": ([], None), "avx2": (["-mavx2"], "avx2"),
         "avx512": (["-mavx512f"], "avx512f")}
WRAPPER = """
#include "attention_decode.cpp"
#include "glu.cpp"
#include "rms_norm.cpp"
#include "rotary.cpp"
extern "C" {
void t_glu(const float* g, const float* u, int64_t T, int I, int act, float* out) {
  ft::glu(g, I, u, I, T, I, act, out);
}
void t_attention(const float* q, const float* k, const float* v, const int64_t* ns, float* kc,
                 float* vc, const int64_t* s, const uint8_t* vis, int B, int S, int Hq,
                 int Hkv, int D, float scale, float* out) {
  ft::attention_decode(q, k, v, ns, kc, vc, s, vis, B, S, Hq, Hkv, D, scale, out);
}
void t_rms_norm(const float* x, const float* w, int64_t rows, int dim, float eps, int unit,
                float* y) {
  ft::rms_norm(x, w, rows, dim, eps, unit != 0, y);
}
int t_rotary(const float* x, const float* cos, const float* sin, int64_t P, const int64_t* pos,
             int64_t T, int heads, int D, float* y) {
  return ft::rotary_neox(x, cos, sin, P, pos, T, heads, D, y);
}
}
"""


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split()}


@pytest.fixture(scope="module", params=list(TIERS))
def tier_lib(request, tmp_path_factory) -> c.CDLL:
    flags, needs = TIERS[request.param]
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    if needs and needs not in _cpu_flags():
        pytest.skip(f"this CPU has no {needs}")
    out = tmp_path_factory.mktemp(request.param)
    src = out / "tier.cpp"
    src.write_text(WRAPPER)
    lib = out / "tier.so"
    subprocess.run([cxx, "-O2", "-std=c++17", "-fPIC", "-shared", "-DFT_ONE_TIER",
                    "-ffp-contract=off", "-Wno-psabi", "-march=x86-64", *flags, f"-I{CSRC}",
                    str(src), "-o", str(lib)], check=True, capture_output=True, timeout=300)
    return c.CDLL(str(lib))


@pytest.mark.parametrize(("heads", "kv_heads", "D"), [(32, 4, 128), (20, 2, 32), (6, 2, 40)])
def test_attention_at_every_width(tier_lib, heads, kv_heads, D):
    torch.manual_seed(5)
    B, S, N = 2, 19, 64
    q, k, v = torch.randn(B, heads, D), torch.randn(B, kv_heads, D), torch.randn(B, kv_heads, D)
    kc, vc = torch.randn(N, kv_heads, D), torch.randn(N, kv_heads, D)
    slots = torch.randperm(N)[: B * S].reshape(B, S).contiguous()
    visible = torch.ones(B, S, dtype=torch.bool)
    visible[1, 11:] = False  # the second sequence is shorter
    new = torch.tensor([slots[0, S - 1], slots[1, 10]])
    out = torch.empty_like(q)
    tier_lib.t_attention(*(c.c_void_p(t.data_ptr()) for t in (q, k, v, new, kc, vc, slots,
                                                               visible)),
                         B, S, heads, kv_heads, D, c.c_float(D**-0.5), c.c_void_p(out.data_ptr()))
    assert torch.equal(kc[new], k) and torch.equal(vc[new], v)
    keys = kc[slots].transpose(1, 2)  # (B, Hkv, S, D)
    values = vc[slots].transpose(1, 2)
    want = F.scaled_dot_product_attention(q[:, :, None], keys, values,
                                          attn_mask=visible[:, None, None], scale=D**-0.5,
                                          enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(out, want, atol=2e-6, rtol=2e-5)


def test_rms_norm_and_rotary_at_every_width(tier_lib):
    torch.manual_seed(6)
    for dim, unit in [(2048, False), (37, True)]:
        norm = RMSNorm(dim, 1e-6, unit_offset=unit)
        norm.weight.data.normal_()
        x = torch.randn(3, dim)
        y = torch.empty_like(x)
        tier_lib.t_rms_norm(c.c_void_p(x.data_ptr()), c.c_void_p(norm.weight.data_ptr()), 3,
                            dim, c.c_float(1e-6), int(unit), c.c_void_p(y.data_ptr()))
        torch.testing.assert_close(y, norm.reference(x), atol=1e-6, rtol=1e-5)
    rot = Rotary(64, 1e4, 32)
    x, pos = torch.randn(5, 3, 64), torch.tensor([0, 7, 31, 2, 2])
    y = torch.empty_like(x)
    assert tier_lib.t_rotary(c.c_void_p(x.data_ptr()), c.c_void_p(rot.cos.data_ptr()),
                             c.c_void_p(rot.sin.data_ptr()), 32, c.c_void_p(pos.data_ptr()), 5,
                             3, 64, c.c_void_p(y.data_ptr())) == 0
    assert torch.equal(y, rot.reference(x, pos))


@pytest.mark.parametrize(("act", "name"), [(0, "silu"), (1, "gelu_pytorch_tanh")])
def test_glu_at_every_width_gives_the_librarys_bits(tier_lib, act, name):
    """Each width's activation is within float32 rounding of torch's and has the bits of the
    library's (the CPU's widest): glu.cpp is built without contraction."""
    from freetoken.cpu.library import native
    from freetoken.kernels.activation import ACTIVATIONS

    torch.manual_seed(7)
    g, u = torch.randn(3, 1000) * 6, torch.randn(3, 1000)
    g[0, :6] = torch.tensor([-100.0, -87.5, 0.0, 1e-20, 88.0, 100.0])
    out, lib_out = torch.empty_like(g), torch.empty_like(g)
    tier_lib.t_glu(*(c.c_void_p(t.data_ptr()) for t in (g, u)), 3, 1000, act,
                   c.c_void_p(out.data_ptr()))
    native().ft_glu(g.data_ptr(), 1000, u.data_ptr(), 1000, 3, 1000, act, lib_out.data_ptr())
    assert torch.equal(out, lib_out)
    want = ACTIVATIONS[name](g.double()) * u.double()
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-6)
