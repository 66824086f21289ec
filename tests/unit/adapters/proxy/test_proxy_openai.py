"""OpenAI request validation, prompt token estimates and body rewriting."""

from __future__ import annotations

import json

import pytest
from borrowd.adapters.proxy.openai import (
    Endpoint,
    FieldError,
    estimate_text_tokens,
    parse_completion_request,
    rewrite_body,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


def _raw(**fields) -> bytes:
    return json.dumps({**CHAT, **fields}).encode()


@pytest.mark.parametrize(
    ("text", "tokens"),
    [("", 0), ("hi", 1), ("hello", 2), ("hello there friend", 6), ("a  b\\nc", 3)],
    ids=["empty", "short-word", "five-chars", "three-words", "whitespace"],
)
def test_text_token_estimate(text: str, tokens: int) -> None:
    """Each whitespace word counts ceil(len / 4) tokens."""
    assert estimate_text_tokens(text.replace("\\n", "\n")) == tokens


def test_chat_request_fields_are_read() -> None:
    """A valid chat body yields its model, stream flag, max_tokens and prompt estimate."""
    req = parse_completion_request(_raw(stream=True, max_completion_tokens=7,
                                        stream_options={"include_usage": True}), Endpoint.CHAT)
    assert (req.model, req.stream, req.max_tokens, req.max_tokens_key) == (
        "m", True, 7, "max_completion_tokens")
    assert req.include_usage
    assert req.prompt_tokens == 4 + 2 + 2


def test_explicit_prompt_tokens_win() -> None:
    """borrowd_prompt_tokens overrides the estimate (load generators)."""
    req = parse_completion_request(_raw(borrowd_prompt_tokens=900), Endpoint.CHAT)
    assert req.prompt_tokens == 900


@pytest.mark.parametrize(
    ("raw", "endpoint", "field"),
    [
        (b"{", Endpoint.CHAT, "body"),
        (b'"text"', Endpoint.CHAT, "body"),
        (b"\xff\xfe", Endpoint.CHAT, "body"),
        (json.dumps({"messages": CHAT["messages"]}).encode(), Endpoint.CHAT, "model"),
        (_raw(messages=[]), Endpoint.CHAT, "messages"),
        (_raw(messages=["hi"]), Endpoint.CHAT, "messages[0]"),
        (_raw(messages=[{"role": "user", "content": 3}]), Endpoint.CHAT, "messages[0].content"),
        (_raw(max_tokens=0), Endpoint.CHAT, "max_tokens"),
        (_raw(max_tokens=True), Endpoint.CHAT, "max_tokens"),
        (_raw(n=0), Endpoint.CHAT, "n"),
        (_raw(stream=1), Endpoint.CHAT, "stream"),
        (_raw(stream_options=[]), Endpoint.CHAT, "stream_options"),
        (_raw(stream_options={"include_usage": "y"}), Endpoint.CHAT,
         "stream_options.include_usage"),
        (_raw(borrowd_prompt_tokens=-1), Endpoint.CHAT, "borrowd_prompt_tokens"),
        (json.dumps({"model": "m"}).encode(), Endpoint.COMPLETIONS, "prompt"),
        (json.dumps({"model": "m", "prompt": [1, "a"]}).encode(), Endpoint.COMPLETIONS,
         "prompt"),
    ],
    ids=["truncated", "not-object", "not-utf8", "no-model", "empty-messages",
         "message-not-object", "content-number", "zero-max-tokens", "bool-max-tokens",
         "zero-n", "int-stream", "options-list", "include-usage-string",
         "negative-prompt-tokens", "no-prompt", "mixed-prompt"],
)
def test_bad_fields_are_named(raw: bytes, endpoint: Endpoint, field: str) -> None:
    """Each malformed field raises FieldError naming it."""
    with pytest.raises(FieldError) as info:
        parse_completion_request(raw, endpoint)
    assert info.value.field == field


def test_completion_prompts_of_every_shape() -> None:
    """String, list-of-strings and token-id prompts are all counted."""
    for prompt, tokens in (("abcd efgh", 2), (["abcd", "efgh"], 2), ([5, 6, 7], 3)):
        raw = json.dumps({"model": "m", "prompt": prompt}).encode()
        assert parse_completion_request(raw, Endpoint.COMPLETIONS).prompt_tokens == tokens


def test_rewrite_injects_priority_caps_and_usage() -> None:
    """The forwarded body carries our priority and max_tokens, and asks for usage."""
    req = parse_completion_request(_raw(priority=-5, max_tokens=900), Endpoint.CHAT)
    body = json.loads(rewrite_body(req, priority=10, max_tokens=64, stream=True,
                                   continuous_usage=True))
    assert body["priority"] == 10
    assert body["max_tokens"] == 64
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    plain = json.loads(rewrite_body(req, priority=None, max_tokens=None, stream=False,
                                    continuous_usage=False))
    assert "priority" not in plain
    assert "stream_options" not in plain
    assert plain["max_tokens"] == 900


@pytest.mark.parametrize(("raw", "field"), [
    (b'{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":NaN}',
     "temperature"),
    (b'{"model":"m","messages":[{"role":"user","content":"hi"}],"top_p":-Infinity}', "top_p"),
    (b'{"model":"m","messages":[{"role":"user","content":"hi"}],"logit_bias":{"5":1e400}}',
     "logit_bias.5"),
    (b'{"model":"m","messages":[{"role":"user","content":"hi","x":[1,NaN]}]}',
     "messages[0].x[1]"),
], ids=["nan", "infinity", "overflow", "nested"])
def test_non_finite_numbers_are_refused_naming_the_field(raw: bytes, field: str) -> None:
    """Python's json reads NaN and Infinity; the proxy refuses them (and numbers that
    overflow to infinity) with the field's path, instead of forwarding them."""
    with pytest.raises(FieldError) as info:
        parse_completion_request(raw, Endpoint.CHAT)
    assert info.value.field == field


def test_stream_interval_is_not_forwarded() -> None:
    """A client cannot thin its stream (and the ITL signal read from it) with
    `stream_interval`."""
    req = parse_completion_request(_raw(stream=True, stream_interval=50), Endpoint.CHAT)
    body = json.loads(rewrite_body(req, priority=0, max_tokens=None, stream=True,
                                   continuous_usage=False))
    assert "stream_interval" not in body
