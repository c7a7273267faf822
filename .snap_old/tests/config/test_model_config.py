"""ModelConfig from a Hugging Face config.json and from the same model's GGUF metadata (the
keys llama.cpp reads, written by our converter) is one object, for every family: GGUF stores
the norm epsilon as float32, and these tiny checkpoints have no tokenizer, so a GGUF of them
carries no token ids (tests/checkpoint/test_stop_tokens.py checks those)."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest

from freetoken.checkpoint import open_checkpoint
from freetoken.checkpoint.convert import convert_to_gguf

TOKEN_IDS = {"bos_token_id", "eos_token_ids"}


@pytest.mark.parametrize("fixture", ["tiny_qwen3_moe", "tiny_gemma4", "tiny_gpt_oss"])
def test_hf_and_gguf_give_one_config(fixture, request, tmp_path):
    src = request.getfixturevalue(fixture)
    hf = open_checkpoint(src).config
    gguf = open_checkpoint(convert_to_gguf(open_checkpoint(src), tmp_path / "m.gguf",
                                           lambda n, s: "f32")).config
    assert gguf.rms_norm_eps == float(np.float32(hf.rms_norm_eps))
    differ = {f.name: (getattr(hf, f.name), getattr(gguf, f.name)) for f in fields(hf)
              if f.name not in TOKEN_IDS | {"rms_norm_eps"}
              and getattr(hf, f.name) != getattr(gguf, f.name)}
    assert not differ
    assert hf.family == fixture.removeprefix("tiny_") and hf.is_moe
