"""What the kernel tests share: where a Triton kernel can run here, and a compile for a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
module, name = sys.argv[1], sys.argv[2]
signature, constexprs, options = map(json.loads, sys.argv[3:])
fn = getattr(importlib.import_module(module), name)
src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
asm = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm
assert asm["cubin"], "no cubin"
if constexprs.get("PDL"):  # no global read before the wait for the kernel before
    ptx = asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    assert wait >= 0, "no griddepcontrol.wait"
    assert "griddepcontrol.launch_dependents" in ptx, "no griddepcontrol.launch_dependents"
    first = ptx.find("ld.global")
    assert first < 0 or wait < first, ptx[first - 400:first + 100]
"""


@pytest.fixture
def triton_runs(request) -> None:
    """Skips the CPU case where Triton would compile (it needs the interpreter on the CPU)."""
    if request.node.callspec.params["device"] == "cpu" and os.environ.get(
            "TRITON_INTERPRET") != "1":
        pytest.skip("compiled Triton kernels need a GPU; without one tests/conftest.py "
                    "selects the interpreter")


def compile_for_sm90(module: str, kernel: str, signature: dict[str, str],
                     constexprs: dict[str, object], pdl: bool = False) -> None:
    """``module.kernel`` through Triton's whole compiler for an sm_90 GPU, which needs no GPU:
    the interpreter runs what the compiler rejects (say, a non-constexpr global). With
    ``pdl``, compiled as ``kernels/build.py:overlap`` launches it, and its PTX must wait for
    the kernel before it ahead of any global read."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    signature = {**signature, "PDL": "constexpr"}
    constexprs = {**constexprs, "PDL": pdl}
    options = {"launch_pdl": True} if pdl else {}
    run = subprocess.run([sys.executable, "-c", _COMPILE, module, kernel, json.dumps(signature),
                          json.dumps(constexprs), json.dumps(options)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
