"""Rotary tables cover the engine's longest sequence, not the config's max_position: the same
logits as full-length tables and as ``transformers``, for every family with its own rope."""

from __future__ import annotations

import pytest
import torch

from freetoken.checkpoint import open_checkpoint
from freetoken.layers.rotary import Rotary
from freetoken.models import build_model
from freetoken.models.loader import load_weights
from tests.models.helpers import hf_logits, our_logits

IDS = [1, 17, 99, 3, 250, 42, 42, 7, 128, 64, 5, 200, 31, 9, 77, 180]


def _model(path, max_len: int) -> torch.nn.Module:
    ckpt = open_checkpoint(path)
    model = build_model(ckpt.config, "resident", max_len)
    load_weights(model, ckpt, torch.device("cpu"), progress=False)
    return model


def _table_lengths(model: torch.nn.Module) -> set[int]:
    return {m.cos.shape[0] for m in model.modules() if isinstance(m, Rotary)}


@pytest.mark.parametrize("family", ["tiny_qwen3_moe", "tiny_gemma3", "tiny_gemma4",
                                    "tiny_gpt_oss"])
def test_tables_follow_the_engines_max_length(family, request):
    path = request.getfixturevalue(family)
    max_position = open_checkpoint(path).config.max_position
    short, full = _model(path, len(IDS)), _model(path, 0)
    assert _table_lengths(short) == {len(IDS)} and _table_lengths(full) == {max_position}
    assert _table_lengths(_model(path, 10 * max_position)) == {max_position}
    got = our_logits(short, IDS, prefill=5)
    assert torch.equal(got, our_logits(full, IDS, prefill=5))
    torch.testing.assert_close(got, hf_logits(path, IDS), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["tiny_qwen3_moe", "tiny_gemma4"])
def test_a_sequence_past_the_tables_is_refused(family, request):
    """A GPU kernel would read past the tables: the forward refuses first, on every device, and
    the sequence that fits still runs."""
    short = _model(request.getfixturevalue(family), len(IDS) - 1)
    with pytest.raises(ValueError, match=f"{len(IDS)} tokens is longer than the {len(IDS) - 1} "
                                         "positions this model was built for"):
        our_logits(short, IDS, prefill=5)
    assert our_logits(short, IDS[:-1], prefill=5).isfinite().all()
