"""Validation of batch input files: line numbers and fields in every error."""

from __future__ import annotations

import json

import pytest
from borrowd.models.batch.input import BatchInputError, InputLimits, parse_input

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def _line(custom_id: str = "a", url: str = "/v1/chat/completions", body: dict | None = None,
          **extra) -> bytes:
    obj = {"custom_id": custom_id, "method": "POST", "url": url,
           "body": CHAT if body is None else body, **extra}
    return json.dumps(obj).encode()


def test_valid_file_gives_items_in_order_with_line_numbers() -> None:
    """Blank lines are skipped; each item keeps its 1-based line number."""
    data = b"\n".join([_line("a"), b"", _line("b", "/v1/completions",
                                                {"model": "m", "prompt": "x"})])
    items = parse_input(data, InputLimits())
    assert [(i.custom_id, i.line, i.url) for i in items] == [
        ("a", 1, "/v1/chat/completions"), ("b", 3, "/v1/completions")]


@pytest.mark.parametrize(
    ("second", "field"),
    [
        (b"{not json", "line"),
        (b"[1, 2]", "line"),
        (_line("a"), "custom_id"),
        (_line(""), "custom_id"),
        (_line("b", url="/v1/embeddings"), "url"),
        (_line("b", method="GET"), "method"),
        (_line("b", body={"messages": CHAT["messages"]}), "body.model"),
        (_line("b", body={**CHAT, "stream": True}), "body.stream"),
        (_line("b", body={**CHAT, "n": 2}), "body.n"),
        (_line("b", body={**CHAT, "max_tokens": 0}), "body.max_tokens"),
        (_line("b", body={"model": "m", "messages": []}), "body.messages"),
        (_line("b", body={"model": "m", "messages": [{"content": "x"}]}),
         "body.messages[0].role"),
        (_line("b", "/v1/completions", {"model": "m", "prompt": [1, 2]}), "body.prompt"),
        (_line("b", extra_field=1), "extra_field"),
    ],
    ids=["not-json", "not-object", "duplicate-custom-id", "empty-custom-id", "unsupported-url",
         "method", "model-missing", "stream", "n", "max-tokens", "no-messages", "role-missing",
         "token-id-prompt", "unknown-field"],
)
def test_bad_line_is_refused_with_line_and_field(second: bytes, field: str) -> None:
    """The error names line 2 and the field at fault."""
    with pytest.raises(BatchInputError) as info:
        parse_input(_line("a") + b"\n" + second, InputLimits())
    assert (info.value.line, info.value.field) == (2, field)
    assert str(info.value).startswith(f"line 2: {field}: ")


@pytest.mark.parametrize(
    ("limits", "data", "line", "field"),
    [
        (InputLimits(max_file_bytes=100), _line("a") + b"\n" + _line("b"), 0, "file"),
        (InputLimits(max_lines=1), _line("a") + b"\n" + _line("b"), 2, "file"),
        (InputLimits(max_line_bytes=50), _line("a"), 1, "line"),
        (InputLimits(), b"\n\n", 0, "file"),
    ],
    ids=["file-bytes", "line-count", "line-bytes", "empty"],
)
def test_size_limits(limits: InputLimits, data: bytes, line: int, field: str) -> None:
    """Oversized files and lines, too many requests and empty files are refused."""
    with pytest.raises(BatchInputError) as info:
        parse_input(data, limits)
    assert (info.value.line, info.value.field) == (line, field)
