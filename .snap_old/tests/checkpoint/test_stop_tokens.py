"""Stop tokens of a Hugging Face directory: config.json's ``eos_token_id`` and
generation_config.json's, both files written by ``transformers``, read the way it reads them."""

from __future__ import annotations

import shutil
from pathlib import Path

from transformers import AutoConfig, GenerationConfig

from freetoken.checkpoint import open_checkpoint


def with_stops(src: Path, dst: Path, config_eos: int | list[int] | None,
               generation_eos: int | list[int] | None) -> Path:
    """``src``'s weights under a config.json and generation_config.json naming these EOS ids
    (None: no generation_config.json)."""
    shutil.copytree(src, dst)
    cfg = AutoConfig.from_pretrained(src)
    cfg.eos_token_id = config_eos
    cfg.save_pretrained(dst)
    (dst / "generation_config.json").unlink(missing_ok=True)
    if generation_eos is not None:
        GenerationConfig(eos_token_id=generation_eos).save_pretrained(dst)
    return dst


def test_gpt_oss_stops_at_return_and_call_as_its_generation_config_lists(tiny_gpt_oss, tmp_path):
    # gpt-oss-20b: config.json 200002 (<|return|>), generation_config [<|return|>,
    # <|endoftext|>, <|call|>]
    d = with_stops(tiny_gpt_oss, tmp_path / "m", 202, [202, 199, 212])
    assert GenerationConfig.from_pretrained(d).eos_token_id == [202, 199, 212]
    assert open_checkpoint(d).config.eos_token_ids == (202, 199, 212)


def test_gemma4_stops_at_the_end_of_turn_ids_only_generation_config_names(tiny_gemma4, tmp_path):
    d = with_stops(tiny_gemma4, tmp_path / "m", 1, [1, 106, 50])
    assert open_checkpoint(d).config.eos_token_ids == \
        tuple(GenerationConfig.from_pretrained(d).eos_token_id) == (1, 106, 50)


def test_the_union_keeps_config_json_first_each_id_once(tiny_gpt_oss, tmp_path):
    d = with_stops(tiny_gpt_oss, tmp_path / "int", [5, 7], 9)
    assert GenerationConfig.from_pretrained(d).eos_token_id == 9
    assert open_checkpoint(d).config.eos_token_ids == (5, 7, 9)
    d = with_stops(tiny_gpt_oss, tmp_path / "repeat", 7, [9, 7, 9])
    assert open_checkpoint(d).config.eos_token_ids == (7, 9)
    d = with_stops(tiny_gpt_oss, tmp_path / "none", 7, None)
    assert not (d / "generation_config.json").exists()
    assert open_checkpoint(d).config.eos_token_ids == (7,)


def test_a_directory_as_save_pretrained_leaves_it(tiny_gemma4):
    written = GenerationConfig.from_pretrained(tiny_gemma4).eos_token_id
    assert open_checkpoint(tiny_gemma4).config.eos_token_ids == (written,) == (1,)


def test_a_gguf_also_stops_at_its_vocabularys_end_of_turn_token():
    """The embedded Gemma-3 GGUF names only <eos> in tokenizer.ggml.eos_token_id; its chat
    turns end with <end_of_turn>, which llama.cpp also stops at (by its text)."""
    import gguf

    from freetoken.checkpoint import default_model_path

    path = default_model_path()
    reader = gguf.GGUFReader(str(path))
    field = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(field.parts[i]).decode() for i in field.data]
    eos = int(reader.fields["tokenizer.ggml.eos_token_id"].parts[-1][0])
    assert open_checkpoint(path).config.eos_token_ids == (eos, tokens.index("<end_of_turn>"))


def test_end_of_turn_tokens_are_special_ones_and_gpt_oss_keeps_end_mid_turn():
    import gguf

    from freetoken.checkpoint.gguf import CONTROL_TYPES, end_of_turn_ids

    assert set(CONTROL_TYPES) == {gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED}
    tokens = ["a", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>"]
    normal, control = int(gguf.TokenType.NORMAL), int(gguf.TokenType.CONTROL)
    types = [normal, control, control, control, control, normal]  # the last one is plain text
    meta = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}
    assert end_of_turn_ids(meta | {"general.architecture": "qwen3moe"}) == [1, 2]
    assert end_of_turn_ids(meta | {"general.architecture": "gpt-oss"}) == [3, 4]
