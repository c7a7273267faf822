"""Every MoE strategy gives the resident model's tokens, loaded through the real loader."""

from __future__ import annotations

import pytest
import torch

from freetoken.checkpoint import open_checkpoint
from freetoken.checkpoint.convert import convert_to_gguf
from tests.models.helpers import load_ours, our_logits

IDS = [1, 17, 99, 3, 250, 42, 42, 7, 128, 64, 5, 200, 31, 9, 77, 180]


@pytest.mark.parametrize("expert_fmt", ["hf", "bf16", "q8_0"])
def test_cpu_strategy_matches_resident(tiny_qwen3_moe, tmp_path, expert_fmt):
    pytest.importorskip("freetoken.moe.cpu")
    from freetoken.cpu.executor import native

    native()  # the C++ library must be built: a missing build fails here, it is not skipped
    path = tiny_qwen3_moe
    if expert_fmt != "hf":
        path = convert_to_gguf(open_checkpoint(tiny_qwen3_moe), tmp_path / "m.gguf",
                               lambda n, s: expert_fmt if ".experts." in n else "f32")
    resident = our_logits(load_ours(path), IDS, prefill=5)
    cpu = our_logits(load_ours(path, strategy="cpu"), IDS, prefill=5)
    torch.testing.assert_close(cpu, resident, atol=2e-3, rtol=2e-3)
    assert torch.equal(cpu.argmax(-1), resident.argmax(-1))


@pytest.mark.parametrize(("strategy", "flags", "logged"), [
    ("cpu", ["--moe-cpu-threads", "1", "--cpu-dense", "torch"],
     "CPU MoE executor ready: threads=1"),
    ("cpu", ["--moe-cpu-threads", "1"],  # auto: dense layers on the pool
     "dense layers on the CPU pool: 9 matrices in their checkpoint format, 2 routers in "
     "float32"),
    ("offload", ["--moe-cache-size", "3"], "MoE plan: offload on 2 q8_0 layers"),
    # the split held fixed, as in tests/server/test_offload_serve.py: moved online it follows
    # measured times, and the pool's bits differ from the slots' float path on --device cpu
    ("hybrid", ["--moe-cache-size", "3", "--moe-cpu-threads", "1", "--moe-hybrid-online", "off"],
     "MoE plan: hybrid on 2 q8_0 layers at a fetch cap of 1"),
    # corrected online: a greedy request's steps fetch every miss (--moe-hybrid-greedy fetch)
    ("hybrid", ["--moe-cache-size", "3", "--moe-cpu-threads", "1"],
     "corrected online; a step with a greedy request fetches every miss"),
])
def test_ft_generate_strategy_equals_resident(tmp_path, monkeypatch, strategy, flags, logged):
    import subprocess
    import sys

    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    model = tmp_path / "tiny.gguf"
    subprocess.run([sys.executable, "-m", "freetoken.cli", "synth", "--preset", "tiny",
                    "--expert-format", "q8_0", "--out", str(model)], check=True,
                   capture_output=True, timeout=300)

    def generate(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "freetoken.cli", "generate", "--device", "cpu", "--model",
             str(model), "--prompt", "hello world", "--max-tokens", "12", "--ids", *extra],
            capture_output=True, text=True, timeout=300)

    resident = generate()
    other = generate("--moe-strategy", strategy, *flags)
    assert resident.returncode == 0 and other.returncode == 0, other.stderr
    assert other.stdout.split() == resident.stdout.split() and len(other.stdout.split()) == 12
    assert logged in other.stderr
