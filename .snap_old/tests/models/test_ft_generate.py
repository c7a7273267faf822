"""``ft generate --model <dir>`` end to end on tiny Gemma-4 and GPT-OSS checkpoints, with a
word-level tokenizer (``w<id>`` is token id): the printed ids are transformers' greedy ones."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.models.helpers import hf_greedy

PROMPT = [17, 99, 3, 250, 42]


def _with_tokenizer(src, dst):
    from tokenizers import Tokenizer, models, pre_tokenizers

    shutil.copytree(src, dst)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "w0"}))
    return dst


@pytest.mark.parametrize(("fixture", "flags"), [
    ("tiny_gemma4", []),
    ("tiny_gemma4", ["--moe-strategy", "offload", "--moe-cache-size", "3"]),
    ("tiny_gpt_oss", []),
    ("tiny_gpt_oss", ["--moe-strategy", "offload", "--moe-cache-size", "3"]),
])
def test_ft_generate_prints_transformers_greedy_ids(fixture, flags, request, tmp_path):
    src = request.getfixturevalue(fixture)
    model = _with_tokenizer(src, tmp_path / "model")
    r = subprocess.run(
        [sys.executable, "-m", "freetoken.cli", "generate", "--device", "cpu", "--model",
         str(model), "--prompt", " ".join(f"w{i}" for i in PROMPT), "--max-tokens", "12",
         "--ids", *flags],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert [int(t) for t in r.stdout.split()] == hf_greedy(src, PROMPT, 12)
    assert "12 output tokens" in r.stderr
