"""Streaming equals whole-text parsing, however the text is cut into deltas.

The deltas a detokenizer yields can end anywhere: inside a marker, a string literal, an escape,
a multi-character string delimiter. Every cut must give the same events once adjacent text
deltas are joined.
"""

from __future__ import annotations

import random

import pytest

from freetoken.server.parsers import make_parser, merge_deltas
from freetoken.server.parsers.events import Event
from tests.server.parsers.cases import CASES, Case, counter


def stream(case: Case, pieces: list[str]) -> list[Event]:
    p = make_parser(case.family, prompt=case.prompt, new_id=counter())
    events: list[Event] = []
    for piece in pieces:
        events += p.feed(piece)
    events += p.finish()
    return merge_deltas(events)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_single_cut_gives_the_same_events(case: Case):
    whole = stream(case, [case.text])
    assert whole, "a case that emits nothing checks nothing"
    t = case.text
    for i in range(len(t) + 1):
        assert stream(case, [t[:i], t[i:]]) == whole, f"cut at {i}: {t[:i]!r} | {t[i:]!r}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_one_character_at_a_time_and_random_cuts(case: Case):
    whole = stream(case, [case.text])
    assert stream(case, list(case.text)) == whole
    rng = random.Random(case.id)
    t = case.text
    for _ in range(40):
        cuts = sorted(rng.sample(range(len(t) + 1), k=min(len(t) + 1, rng.randint(2, 12))))
        pieces = [t[a:b] for a, b in zip([0, *cuts], [*cuts, len(t)], strict=True)]
        assert stream(case, pieces) == whole, pieces


def test_every_two_cuts_of_a_harmony_call():
    """Two cuts reach states one cut cannot (a marker split three ways, a delimiter split
    across a quote); exhaustive on one short case that has all three channels."""
    case = Case("h", "gpt_oss",
                '<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary'
                ' to=functions.f<|message|>{"s":"<|call|>"}<|call|>', "")
    whole = stream(case, [case.text])
    t = case.text
    for i in range(len(t) + 1):
        for j in range(i, len(t) + 1):
            assert stream(case, [t[:i], t[i:j], t[j:]]) == whole, (i, j)
