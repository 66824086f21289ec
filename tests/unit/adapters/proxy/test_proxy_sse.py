"""SSE splitting and the stream tally: tokens, text so far, usage, resumable endings."""

from __future__ import annotations

import json

import pytest
from borrowd.adapters.proxy.openai import Endpoint
from borrowd.adapters.proxy.sse import (
    PREEMPTED,
    StreamTally,
    event_payload,
    strip_usage,
    take_complete,
)


def _chat_chunk(text: str | None, finish: str | None = None, usage: dict | None = None) -> bytes:
    delta = {} if text is None else {"content": text}
    chunk = {"id": "c1", "created": 5, "model": "m",
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        chunk["usage"] = usage
    return json.dumps(chunk).encode()


@pytest.mark.parametrize(
    ("stream", "events", "rest"),
    [
        (b"data: a\n\ndata: b\n\n", [b"data: a\n\n", b"data: b\n\n"], b""),
        (b"data: a\n\ndata: b", [b"data: a\n\n"], b"data: b"),
        (b"data: a", [], b"data: a"),
        (b": ping\n\ndata: x\n\n", [b": ping\n\n", b"data: x\n\n"], b""),
    ],
    ids=["two-complete", "one-partial", "none-complete", "comment"],
)
def test_take_complete_keeps_partial_tail(stream: bytes, events: list[bytes], rest: bytes) -> None:
    """Only complete events are taken; a partial one waits in the buffer for more bytes,
    whether the stream comes in one piece or byte by byte."""
    buffer = bytearray()
    assert take_complete(buffer, stream) == b"".join(events)
    assert bytes(buffer) == rest
    buffer = bytearray()
    taken = b"".join(take_complete(buffer, stream[i:i + 1]) for i in range(len(stream)))
    assert taken == b"".join(events)
    assert bytes(buffer) == rest


def test_take_complete_joins_a_pending_tail() -> None:
    """A partial event completed by the next read comes out whole, with what followed it."""
    buffer = bytearray()
    assert take_complete(buffer, b"data: a\n") == b""
    assert take_complete(buffer, b"\ndata: b\n\ndata: c") == b"data: a\n\ndata: b\n\n"
    assert bytes(buffer) == b"data: c"


def test_event_payload_reads_the_data_line() -> None:
    """The payload of the data line, None for a comment."""
    assert event_payload(b"data: {\"a\":1}") == b'{"a":1}'
    assert event_payload(b"event: x\ndata:  y") == b"y"
    assert event_payload(b": keep-alive") is None


def test_tally_counts_tokens_text_and_usage() -> None:
    """Token chunks are counted, texts joined, upstream usage preferred when present."""
    tally = StreamTally(Endpoint.CHAT, keep_payloads=True)
    assert tally.observe(_chat_chunk("")) == (False, False)
    assert tally.observe(_chat_chunk(" a")) == (True, False)
    assert tally.observe(_chat_chunk(" b", usage={"prompt_tokens": 9,
                                                  "completion_tokens": 2})) == (True, False)
    assert tally.text() == " a b"
    assert tally.output_tokens == 2
    usage_only = json.dumps({"id": "c1", "choices": [], "usage": {
        "prompt_tokens": 9, "completion_tokens": 3}}).encode()
    assert tally.observe(usage_only) == (False, True)
    assert tally.output_tokens == 3
    assert tally.observe(b"[DONE]") == (False, False)
    assert tally.done


@pytest.mark.parametrize(
    ("payload", "has_token"),
    [
        (b'{"choices":[{"delta":{"role":"assistant","content":""}}]}', False),
        (b'{"choices":[{"delta":{"content":" a"}}]}', True),
        (b'{"choices": [{"delta": {"content": " a"}}]}', True),
        (b'{"choices":[{"delta":{"content":"say \\"content\\":\\"x"}}]}', True),
        (b'{"choices":[{"delta":{"reasoning_content":"hm"}}]}', True),
        (b'{"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}', True),
        (b'{"choices":[{"delta":{},"finish_reason":"stop"}]}', False),
    ],
    ids=["role-only", "compact", "spaced", "escaped-quotes", "reasoning", "tool-call",
         "finish-only"],
)
def test_token_detection_without_parsing(payload: bytes, has_token: bool) -> None:
    """Token-carrying chunks are told apart by bytes alone, compact or spaced JSON."""
    assert StreamTally(Endpoint.CHAT).observe(payload)[0] is has_token


def test_preempted_chunk_is_resumable() -> None:
    """The final chunk of a revoked stream carries preempted, the text so far and usage."""
    tally = StreamTally(Endpoint.COMPLETIONS, keep_payloads=True)
    for text in (" x", " y"):
        tally.observe(json.dumps({"id": "r", "choices": [{"index": 0, "text": text,
                                                          "finish_reason": None}]}).encode())
    raw = tally.preempted_chunk("req", "m", prompt_tokens=11, reason="revoked: cut")
    first, done = raw.split(b"\n\n")[:2]
    chunk = json.loads(first[len(b"data: "):])
    assert done == b"data: [DONE]"
    choice = chunk["choices"][0]
    assert (choice["finish_reason"], choice["borrowd_text"], choice["text"]) == (
        PREEMPTED, " x y", "")
    assert choice["borrowd_reason"] == "revoked: cut"
    assert chunk["usage"] == {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13}


@pytest.mark.parametrize(
    ("finish", "reason", "want"),
    [("length", "", "length"), (None, "revoked: cut", PREEMPTED), ("stop", "revoked", "stop")],
    ids=["finished", "cut-midway", "finished-before-cut"],
)
def test_completion_body_assembled_from_stream(finish: str | None, reason: str,
                                               want: str) -> None:
    """A non-streaming body from the stream: finished choices keep their reason."""
    tally = StreamTally(Endpoint.CHAT, keep_payloads=True)
    tally.observe(_chat_chunk(" hi", finish=finish))
    body = json.loads(tally.completion_body("req", "m", 4, preempted_reason=reason))
    choice = body["choices"][0]
    assert body["object"] == "chat.completion"
    assert choice["message"] == {"role": "assistant", "content": " hi"}
    assert choice["finish_reason"] == want
    assert body["usage"]["completion_tokens"] == 1


def test_non_streaming_body_keeps_tool_calls_reasoning_and_logprobs() -> None:
    """Deltas of tool calls (by index), reasoning and logprobs are merged into the message,
    as vLLM's own non-streaming answer has them."""
    tally = StreamTally(Endpoint.CHAT, keep_payloads=True)
    chunks = [
        {"delta": {"role": "assistant", "reasoning_content": "think "}},
        {"delta": {"reasoning_content": "more"},
         "logprobs": {"content": [{"token": "a", "logprob": -0.1}]}},
        {"delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                   "function": {"name": "get", "arguments": '{"ci'}}]},
         "logprobs": {"content": [{"token": "b", "logprob": -0.2}]}},
        {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ty":"x"}'}}]}},
        {"delta": {}, "finish_reason": "tool_calls"},
    ]
    for choice in chunks:
        tally.observe(json.dumps({"id": "c", "choices": [{"index": 0, **choice}]}).encode())
    body = json.loads(tally.completion_body("req", "m", 4, preempted_reason=""))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant", "content": None, "reasoning_content": "think more",
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "get", "arguments": '{"city":"x"}'}}]}
    assert [t["token"] for t in choice["logprobs"]["content"]] == ["a", "b"]


def test_error_events_are_told_apart() -> None:
    """vLLM's in-stream error event is kept as the stream's error, with its status."""
    tally = StreamTally(Endpoint.CHAT, keep_payloads=True)
    tally.observe(_chat_chunk(" a"))
    assert tally.error is None
    tally.observe(b'{"error": {"message": "boom", "type": "BadRequestError", "code": 400}}')
    assert tally.error_detail() == (400, {"message": "boom", "type": "BadRequestError",
                                          "code": 400})
    assert tally.observe(b"[DONE]") == (False, False) and tally.done


@pytest.mark.parametrize("payload", [
    b'{"id":"c","choices":[{"index":0,"delta":{"content":" a"}}],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}',
    b'{"id":"c","choices":[{"index":0,"delta":{"content":" a"}}], "usage": {"prompt_tokens":3,'
    b'"prompt_tokens_details":{"cached_tokens":0},"completion_tokens":1}}',
    b'{"id":"c","choices":[{"index":0,"delta":{"content":" a"}}],"usage":null}',
], ids=["compact", "nested", "null"])
def test_strip_usage_removes_only_the_usage_member(payload: bytes) -> None:
    """The per-chunk usage the proxy asked for on the client's behalf is cut out; the rest
    of the chunk is intact JSON."""
    stripped = json.loads(strip_usage(payload))
    assert "usage" not in stripped
    assert stripped["choices"][0]["delta"] == {"content": " a"}
