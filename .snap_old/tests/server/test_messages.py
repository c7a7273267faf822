"""The Anthropic Messages API with the official ``anthropic`` client against a live server
(Gemma-3 270M on the CPU), checked against the same engine through the OpenAI API."""

from __future__ import annotations

import json
import socket
import time

import anthropic
import httpx
import pytest

MODEL = "gemma-3-270m-q4_k_m.gguf"
SYSTEM = "Answer briefly."
QUESTION = "Name a colour."
GREEDY = {"temperature": 0}  # the client no longer has the argument; the API still does
TOOL = {"name": "get_weather", "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def chat_text(client, messages, max_tokens=12, **kw) -> str:
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                       temperature=0, **kw)
    return r.choices[0].message.content


def test_greedy_message_is_the_chat_completions_text(client, anthropic_client):
    want = chat_text(client, [{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": QUESTION}])
    m = anthropic_client.messages.create(
        model=MODEL, max_tokens=12, system=SYSTEM, extra_body=GREEDY,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name a "},
                                                {"type": "text", "text": "colour."}]}])
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want
    assert m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 12


def test_stream_events_in_documented_order(anthropic_client):
    kw = {"model": MODEL, "max_tokens": 16, "extra_body": GREEDY, "system": SYSTEM,
          "messages": [{"role": "user", "content": QUESTION}]}
    whole = anthropic_client.messages.create(**kw)
    events = list(anthropic_client.messages.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    body = [k for k in kinds[1:-2] if k != "ping"]
    assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
    assert set(body[1:-1]) == {"content_block_delta"} and len(body) > 4
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert {e.index for e in events if hasattr(e, "index")} == {0}
    assert "".join(e.delta.text for e in deltas) == whole.content[0].text
    start, end = events[0].message, events[-2]
    # the start counts the whole prompt; the delta's usage is the final split, as whole's
    prompt = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert start.usage.input_tokens == prompt and start.stop_reason is None
    assert end.usage.input_tokens + end.usage.cache_read_input_tokens == prompt
    assert end.usage.output_tokens == whole.usage.output_tokens == 16
    assert end.delta.stop_reason == whole.stop_reason == "max_tokens"


def test_stream_helper_builds_the_same_message(anthropic_client):
    kw = {"model": MODEL, "max_tokens": 10, "extra_body": GREEDY,
          "messages": [{"role": "user", "content": QUESTION}]}
    whole = anthropic_client.messages.create(**kw)
    with anthropic_client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequence_cuts_and_names_itself(anthropic_client):
    kw = {"model": MODEL, "max_tokens": 24, "extra_body": GREEDY,
          "messages": [{"role": "user", "content": "Count: 1, 2, 3, 4,"}]}
    full = anthropic_client.messages.create(**kw).content[0].text
    assert len(full) > 12, full
    stop = full[len(full) // 2:len(full) // 2 + 3]
    want = full[:full.index(stop)]  # a stop string ends the text where it first appears
    m = anthropic_client.messages.create(stop_sequences=["never-seen", stop], **kw)
    assert m.content[0].text == want and m.stop_reason == "stop_sequence"
    assert m.stop_sequence == stop
    streamed = list(anthropic_client.messages.create(stop_sequences=[stop], stream=True, **kw))
    text = "".join(e.delta.text for e in streamed if e.type == "content_block_delta")
    assert text == want
    assert streamed[-2].delta.stop_reason == "stop_sequence"
    assert streamed[-2].delta.stop_sequence == stop


def test_count_tokens_is_the_engines_prompt_count(client, anthropic_client):
    messages = [{"role": "user", "content": QUESTION}]
    counted = anthropic_client.messages.count_tokens(model=MODEL, system=SYSTEM,
                                                     messages=messages)
    m = anthropic_client.messages.create(model=MODEL, max_tokens=1, system=SYSTEM,
                                         messages=messages)
    # the engine's own count, through the other API, of the same conversation
    r = client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "system", "content": SYSTEM}, *messages])
    total = m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    assert counted.input_tokens == total == r.usage.prompt_tokens


def test_tools_are_rendered_as_the_openai_ones(client, anthropic_client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    bare = anthropic_client.messages.count_tokens(model=MODEL, messages=messages)
    with_tool = anthropic_client.messages.count_tokens(model=MODEL, messages=messages,
                                                       tools=[TOOL])
    none = anthropic_client.messages.count_tokens(model=MODEL, messages=messages, tools=[TOOL],
                                                  tool_choice={"type": "none"})
    fn = {"name": TOOL["name"], "description": TOOL["description"],
          "parameters": TOOL["input_schema"]}
    r = client.chat.completions.create(model=MODEL, max_tokens=1, messages=messages,
                                       tools=[{"type": "function", "function": fn}])
    assert with_tool.input_tokens == r.usage.prompt_tokens > bare.input_tokens
    assert none.input_tokens == bare.input_tokens


def test_tool_round_trip_matches_chat_completions(client, anthropic_client):
    call = {"city": "Paris"}
    m = anthropic_client.messages.create(
        model=MODEL, max_tokens=10, extra_body=GREEDY, tools=[TOOL], messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": call}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"}]}])
    fn = {"name": TOOL["name"], "description": TOOL["description"],
          "parameters": TOOL["input_schema"]}
    want = chat_text(client, [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(call)}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21 C"}],
        max_tokens=10, tools=[{"type": "function", "function": fn}])
    assert m.content[0].text == want and m.stop_reason == "max_tokens"


def test_models_list_reads_in_both_clients(client, anthropic_client):
    models = list(anthropic_client.models.list())
    assert [m.id for m in models] == [MODEL] and models[0].type == "model"
    assert [m.id for m in client.models.list().data] == [MODEL]


BAD = [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                 "input": {}}]}]}, "'tool_use' blocks"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]}, "'nope'"),
    ({"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f"}]}]}, "messages.0.content.0.input"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": []}]}, "messages.0.content"),
    ({"max_tokens": 100000}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"frobnicate": True}, "frobnicate"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config"),
]


@pytest.mark.parametrize("change, words", BAD)
def test_bad_requests_are_anthropic_400s(gemma_server, anthropic_client, change, words):
    body = {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]} | change
    r = httpx.post(f"{gemma_server.url}/v1/messages", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert words in err["error"]["message"]
    ok = anthropic_client.messages.create(model=MODEL, max_tokens=2,
                                          messages=[{"role": "user", "content": "hi"}])
    # still serving (sampled at the default temperature, a reply may end at its first token)
    assert ok.usage.input_tokens > 0 and 1 <= ok.usage.output_tokens <= 2
    assert ok.stop_reason in ("max_tokens", "end_turn")


def test_client_raises_anthropic_errors(anthropic_client):
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model=MODEL, max_tokens=10**6,
                                         messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        anthropic_client.messages.create(model="claude-9", max_tokens=4,
                                         messages=[{"role": "user", "content": "x"}])
    assert MODEL in e.value.message
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client.post("/v1/messages/nothing", cast_to=object, body={})


def _abandon(url: str, path: str, body: dict) -> None:
    """Send a non-streaming request on a raw socket and close it after 1 s."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
                  f"\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(1)
        stats = httpx.get(f"{url}/v1/stats", timeout=10).json()
        assert stats["in_flight"] == 1  # it was running when the client went


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
                         "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story."}],
                              "max_tokens": 400, "temperature": 0, "ignore_eos": True}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 400, "temperature": 0,
                      "messages": [{"role": "user", "content": "Tell a long story."}]}),
])
def test_abandoned_request_is_aborted(gemma_server, path, body):
    _abandon(gemma_server.url, path, body)
    gone = time.monotonic()
    while True:
        stats = httpx.get(f"{gemma_server.url}/v1/stats", timeout=10).json()
        if stats["in_flight"] == 0 and stats["engine"]["running"] == 0:
            break
        assert time.monotonic() - gone < 1.0, stats  # 400 tokens take tens of seconds here
        time.sleep(0.05)
