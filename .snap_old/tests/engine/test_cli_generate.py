"""`ft generate` as a user runs it: the embedded default model, streamed text on stdout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REFERENCE = json.loads((Path(__file__).parent.parent / "data" / "gemma3_270m_llamacpp.json")
                       .read_text())


def test_default_model_streams_llamacpps_text():
    case = next(c for c in REFERENCE["cases"] if c["prompt"] == "A, B, C, D, E, F,")
    r = subprocess.run(
        [sys.executable, "-m", "freetoken.cli", "generate", "--device", "cpu",
         "--prompt", case["prompt"], "--max-tokens", "16"],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr
    want = case["prompt"] + case["output_text"]
    # 16 of the 32 reference tokens: the stdout text is a prefix of llama.cpp's 32-token text
    assert want.startswith(r.stdout.rstrip("\n")) and len(r.stdout) > len(case["prompt"]) + 10
    assert "16 output tokens" in r.stderr and "tokens/s" in r.stderr
    from freetoken.cpu.library import available

    if available() is None:  # the README's command runs the dense layers on the CPU pool
        assert "cpu_dense=pool" in r.stderr and "core plan:" in r.stderr


def test_bad_flag_values_are_one_line_errors():
    r = subprocess.run(
        [sys.executable, "-m", "freetoken.cli", "generate", "--device", "cpu", "--top-p", "2"],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.strip() == "ft generate: error: top_p must be in (0, 1], got 2.0"
