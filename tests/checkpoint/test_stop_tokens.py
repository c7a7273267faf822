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
