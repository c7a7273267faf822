"""Real text: the Gemma-3 270M GGUF from PyPI, greedy, against llama.cpp's tokens.

The reference tokens come from ``scripts/llamacpp_reference.py`` (llama-cpp-python, f32 KV
cache) and are stored in tests/data, so this test needs no llama.cpp.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from freetoken.engine.detok import Detokenizer
from freetoken.engine.sample import SamplingParams

REFERENCE = json.loads((Path(__file__).parent.parent / "data" / "gemma3_270m_llamacpp.json")
                       .read_text())
CASES = REFERENCE["cases"]


@pytest.fixture(scope="module")
def engine():
    from freetoken.checkpoint import default_model_path
    from freetoken.config import EngineConfig
    from freetoken.engine.engine import Engine

    path = default_model_path()
    assert path.name == REFERENCE["model"]
    return Engine(EngineConfig(model=str(path), device="cpu", dtype="float32",
                               moe_strategy="resident", max_seq_len=512), progress=False)


@pytest.mark.parametrize("case", CASES, ids=[c["prompt"][:20] for c in CASES])
def test_prompt_tokens_match_llamacpp(engine, case):
    assert engine.encode(case["prompt"]) == case["prompt_ids"]


@pytest.mark.parametrize("case", CASES, ids=[c["prompt"][:20] for c in CASES])
def test_greedy_tokens_match_llamacpp(engine, case):
    n = len(case["output_ids"])
    got = engine.generate(case["prompt_ids"], SamplingParams(max_tokens=n))
    assert got == case["output_ids"]


def test_streamed_text_equals_full_decode(engine):
    case = max(CASES, key=lambda c: sum(ord(ch) > 127 for ch in c["output_text"]))
    detok = Detokenizer(engine.tokenizer)
    streamed = "".join(detok.push(t) for t in case["output_ids"])
    assert streamed == engine.tokenizer.decode(case["output_ids"], skip_special_tokens=True)
