"""A GGUF's tokenizer comes from its ``tokenizer.ggml.*`` fields even where transformers cannot
read the architecture's config (Gemma-4's per-layer KV head counts, GPT-OSS): the ids it gives
are the file's own vocabulary entries, as the gguf package reads them, and its end token is the
file's."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFReader

from freetoken.checkpoint.tokenizer import load_gguf_tokenizer


def _field(reader: GGUFReader, name: str) -> object:
    return reader.fields[name].contents()


@pytest.mark.parametrize("preset, experts", [("gemma4-26b-a4b", 8), ("gpt-oss-20b", 4)])
def test_tokenizer_from_the_files_vocabulary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             preset: str, experts: int):
    from freetoken.cli import main

    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / f"{preset}.gguf"
    assert main(["synth", "--preset", preset, "--layers", "2", "--experts", str(experts),
                 "--vocab", "512", "--out", str(out)]) == 0
    tok = load_gguf_tokenizer(out)
    reader = GGUFReader(out)
    vocab = _field(reader, "tokenizer.ggml.tokens")
    ids = tok("hello world, the cat")["input_ids"]
    assert ids and all(0 <= i < len(vocab) for i in ids)
    assert tok.convert_ids_to_tokens(ids) == [vocab[i] for i in ids]
    assert tok.eos_token_id == _field(reader, "tokenizer.ggml.eos_token_id")
    again = load_gguf_tokenizer(out)  # from the cache now
    assert again("hello world, the cat")["input_ids"] == ids


@pytest.mark.parametrize("preset, experts", [("gemma4-26b-a4b", 8), ("gpt-oss-20b", 4)])
def test_the_vocabulary_copy_tokenises_as_the_file(tmp_path: Path, preset: str, experts: int):
    """Where transformers cannot parse a file's architecture keys at all (5.17 on GPT-OSS's
    rope.scaling.*), the tokenizer comes from a copy holding the vocabulary alone: it gives
    the ids transformers gives for the file itself."""
    from freetoken.checkpoint.tokenizer import _from_vocabulary_copy, _tokenizer_fields
    from freetoken.cli import main

    out = tmp_path / f"{preset}.gguf"
    assert main(["synth", "--preset", preset, "--layers", "2", "--experts", str(experts),
                 "--vocab", "512", "--out", str(out)]) == 0
    from transformers import PreTrainedTokenizerFast

    direct = PreTrainedTokenizerFast.from_pretrained(str(tmp_path), gguf_file=out.name)
    copy = _from_vocabulary_copy(out, _tokenizer_fields(out), tmp_path / "scratch")
    text = "hello world, the cat sat on 123 mats \u00e9t\u00e9 <|end|>"
    assert copy(text)["input_ids"] == direct(text)["input_ids"]
    assert copy.eos_token_id == direct.eos_token_id == _field(reader := GGUFReader(out),
                                                              "tokenizer.ggml.eos_token_id")
    assert copy.convert_ids_to_tokens(copy(text)["input_ids"]) == [
        _field(reader, "tokenizer.ggml.tokens")[i] for i in copy(text)["input_ids"]]
    assert not list((tmp_path / "scratch").iterdir())  # the copy is gone
