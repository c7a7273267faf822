"""Log-probabilities on both OpenAI endpoints, through the official client on a live server:
the values against transformers' log-softmax of the same checkpoint's logits, the top ones in
order, streamed the same as whole."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from tests.server.conftest import Server, openai_client, start_tiny_chat

PROMPT = [300, 301, 302, 303, 304, 305]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory) -> Iterator[Server]:
    s = start_tiny_chat(tiny_model, tmp_path_factory.mktemp("logprobs"), "--dtype", "float32",
                        "--moe-strategy", "resident", "--cpu-dense", "torch", "--kv-tokens",
                        "1024")
    yield s
    s.stop()


@pytest.fixture()
def client(server):
    return openai_client(server)


def transformers_greedy(model_dir: str, steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of PROMPT and the log-softmax rows (steps, vocab)
    each of its tokens was drawn from."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        logits = model(torch.tensor([ids])).logits[0, len(PROMPT) - 1:-1]
    return ids[len(PROMPT):], torch.log_softmax(logits.float(), dim=-1)


def test_completion_logprobs_are_the_models(client, tiny_model):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})
    r = client.completions.create(logprobs=3, **kwargs)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    ids, rows = transformers_greedy(tiny_model, 8)
    chosen = rows[torch.arange(8), torch.tensor(ids)]
    assert torch.allclose(torch.tensor(lp.token_logprobs), chosen, atol=2e-3)
    for top, row in zip(lp.top_logprobs, rows, strict=True):
        values = list(top.values())
        assert values == sorted(values, reverse=True)
        assert torch.allclose(torch.tensor(values), row.topk(len(values)).values, atol=2e-3)
    zero = client.completions.create(logprobs=0, **kwargs).choices[0].logprobs
    assert zero.top_logprobs == [{}] * 8 and zero.token_logprobs == lp.token_logprobs


def test_chat_logprobs_whole_and_streamed(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "hello there"}],
                  max_tokens=6, temperature=0, logprobs=True, top_logprobs=4,
                  extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kwargs)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert c.bytes == list(c.token.encode())
        assert len(c.top_logprobs) == 4 and c.top_logprobs[0].logprob == c.logprob  # greedy
        values = [t.logprob for t in c.top_logprobs]
        assert values == sorted(values, reverse=True) and sum(map(math.exp, values)) <= 1.0001
    streamed = [t for chunk in client.chat.completions.create(stream=True, **kwargs)
                for choice in chunk.choices if choice.logprobs
                for t in choice.logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(c.token, c.logprob) for c in content]
    plain = client.chat.completions.create(**kwargs | {"logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == r.choices[0].message.content


def test_completion_stream_logprobs_match_whole(client):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].logprobs
    tokens, values, offsets = [], [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            if choice.logprobs:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
                offsets += choice.logprobs.text_offset
    assert (tokens, values, offsets) == (whole.tokens, whole.token_logprobs, whole.text_offset)
