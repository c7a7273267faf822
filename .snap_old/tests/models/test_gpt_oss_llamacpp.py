"""Our reading of a GPT-OSS GGUF against llama.cpp's: a small synthetic checkpoint (mxfp4
experts) that ``ft synth`` writes again here, bytes checked against the recorded file, decoded
greedily from prompts of random ids under each strategy. Tokens must be llama.cpp's
(``scripts/llamacpp_synth_reference.py`` recorded them) up to each prompt's first step where
llama.cpp's top-2 margin is under CLEAR: the engines' activation encodings move these logits
by up to ~0.07, and a near-tie in a router moves them further."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from freetoken.config import CacheSizing
from tests.models.helpers import load_ours, our_greedy

DATA = Path(__file__).resolve().parents[1] / "data" / "gpt_oss_20b_synth_llamacpp.json"
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "llamacpp_synth_reference.py"
REFERENCE = json.loads(DATA.read_text())
CLEAR = 0.25


def _script():
    spec = importlib.util.spec_from_file_location("llamacpp_synth_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def synth_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from freetoken.checkpoint.synth import write_synth

    script = _script()
    path = write_synth(script.spec_of(REFERENCE), tmp_path_factory.mktemp("oss") / "m.gguf")
    assert script.sha256_of(path) == REFERENCE["sha256"], (
        "ft synth no longer writes the recorded file: record it again with "
        "scripts/llamacpp_synth_reference.py")
    return path


def _clear_steps(case: dict) -> int:
    return next((i for i, m in enumerate(case["margins"]) if m < CLEAR), len(case["margins"]))


@pytest.mark.parametrize("strategy", ["resident", "offload", "cpu", "hybrid"])
def test_greedy_tokens_are_llamacpps(synth_gguf, tmp_path, monkeypatch, strategy):
    from freetoken.cpu import executor as cx

    if strategy in ("cpu", "hybrid") and (why := cx.available()) is not None:
        pytest.skip(why)
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    model = load_ours(synth_gguf, strategy=strategy, cache=CacheSizing("size", 12), max_fetch=1,
                      online=False)
    cases = REFERENCE["cases"]
    assert sum(_clear_steps(c) for c in cases) >= 32  # the check reaches a fair share of steps
    for i, case in enumerate(cases):
        n = _clear_steps(case)
        got = our_greedy(model, case["prompt_ids"], n) if n else []
        assert got == case["output_ids"][:n], f"prompt {i}"
