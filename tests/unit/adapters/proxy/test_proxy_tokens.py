"""What a batch request's prompt costs: a real (small, trained here) tokenizer.json or the
UTF-8 byte bound, every part of the request counted, the claimed count only a lower bound,
and the release's true-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from borrowd.adapters.proxy.app import ProxyServer
from borrowd.adapters.proxy.config import parse_config
from borrowd.adapters.proxy.openai import Endpoint, parse_completion_request
from borrowd.adapters.proxy.tokens import (
    MESSAGE_OVERHEAD_TOKENS,
    PromptCounter,
    load_tokenizer,
    trued_up_output_tokens,
    utf8_bytes,
)
from borrowd.models.errors import ConfigError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = ["hello world the quick brown fox jumps over the lazy dog"] * 50


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A byte-level BPE tokenizer trained in-process on a tiny English corpus."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


def _chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       **fields}).encode()


def test_tokenizer_counts_exactly_and_bytes_bound_it(tokenizer_json: str) -> None:
    """Known English words are a token each under the trained tokenizer; unknown CJK text
    falls apart into bytes; the byte bound is never below either."""
    count = load_tokenizer(tokenizer_json)
    assert count("hello world") == 2
    cjk = "你好世界" * 10
    assert count(cjk) == utf8_bytes(cjk) == 120
    for text in ("hello world the quick brown fox", cjk, "naïve café"):
        assert utf8_bytes(text) >= count(text)


@pytest.mark.parametrize("content", ["missing", "garbage"])
def test_unreadable_tokenizer_names_the_key(tmp_path: Path, content: str) -> None:
    """A missing or broken tokenizer.json is a config error naming proxy.tokenizer_path."""
    path = tmp_path / "tokenizer.json"
    if content == "garbage":
        path.write_text("{not json")
    with pytest.raises(ConfigError, match=r"proxy\.tokenizer_path"):
        load_tokenizer(str(path))


def test_claimed_count_is_only_a_lower_bound() -> None:
    """`borrowd_prompt_tokens: 0` does not make a 10k-byte prompt free; a larger claim wins."""
    counter = PromptCounter()
    text = "x" * 10_000
    small = parse_completion_request(json.dumps({
        "model": "m", "prompt": text, "borrowd_prompt_tokens": 0}).encode(), Endpoint.COMPLETIONS)
    assert counter.prompt_tokens(small) == 10_000
    large = parse_completion_request(json.dumps({
        "model": "m", "prompt": "a", "borrowd_prompt_tokens": 500}).encode(),
        Endpoint.COMPLETIONS)
    assert counter.prompt_tokens(large) == 500


def test_every_part_of_a_chat_request_counts() -> None:
    """Tools, tool_choice, response_format, tool calls in history and media parts are
    charged, not only the message text."""
    counter = PromptCounter(media_part_tokens=1000)
    base = counter.prompt_tokens(parse_completion_request(_chat(), Endpoint.CHAT))
    assert base == MESSAGE_OVERHEAD_TOKENS + len("hi") + len('"user"'[1:-1])
    tools = [{"type": "function", "function": {"name": "f" * 5000, "parameters": {}}}]
    with_tools = parse_completion_request(_chat(tools=tools, tool_choice="auto",
                                                response_format={"type": "json_object"}),
                                          Endpoint.CHAT)
    assert counter.prompt_tokens(with_tools) > base + 5000
    image = parse_completion_request(json.dumps({"model": "m", "messages": [{
        "role": "user", "content": [{"type": "text", "text": "look"},
                                    {"type": "image_url", "image_url": {"url": "data:x"}}]},
    ]}).encode(), Endpoint.CHAT)
    assert counter.prompt_tokens(image) == MESSAGE_OVERHEAD_TOKENS + 4 + 1000 + len("user")
    history = parse_completion_request(json.dumps({"model": "m", "messages": [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c", "type": "function",
                         "function": {"name": "f", "arguments": "{" + "a" * 3000 + "}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "result"}]}).encode(), Endpoint.CHAT)
    assert counter.prompt_tokens(history) > 3000


def test_cjk_is_not_under_counted() -> None:
    """CJK text without spaces costs at least a token per character under the byte bound
    (the old word estimate gave ceil(chars / 4) for the whole run)."""
    text = "这是一个没有空格的很长的中文句子" * 20
    req = parse_completion_request(json.dumps({"model": "m", "prompt": text}).encode(),
                                   Endpoint.COMPLETIONS)
    assert PromptCounter().prompt_tokens(req) >= len(text)


def test_list_prompts_count_every_prompt() -> None:
    """A list prompt is several sequences; each prompt is counted."""
    req = parse_completion_request(json.dumps({"model": "m", "prompt": ["abcd"] * 50, "n": 2}
                                              ).encode(), Endpoint.COMPLETIONS)
    assert (req.prompts, req.sequences) == (50, 100)
    assert PromptCounter().prompt_tokens(req) == 200
    ids = parse_completion_request(json.dumps({"model": "m", "prompt": [[1, 2], [3, 4, 5]]}
                                              ).encode(), Endpoint.COMPLETIONS)
    assert (ids.prompts, PromptCounter().prompt_tokens(ids)) == (2, 5)


@pytest.mark.parametrize(("output", "charged", "reported", "used"), [
    (10, 100, None, 10),
    (10, 100, 100, 10),
    (10, 100, 40, 0),
    (100, 100, 40, 40),
    (10, 100, 130, 40),
], ids=["unknown", "exact", "overcharged-clamped", "overcharged", "undercharged"])
def test_release_trues_up_the_prompt_charge(output: int, charged: int, reported: int | None,
                                            used: int) -> None:
    """The output count reported at release moves the bucket's charge to the engine's own
    prompt count (within what the release can refund)."""
    assert trued_up_output_tokens(output, charged, reported) == used


def _proxy_config(**proxy: object) -> dict:
    return {"proxy": {"upstreams": ["http://127.0.0.1:9"], **proxy},
            "tenants": {"etl": {"keys": ["k"], "class": "batch"}}}


def test_the_proxy_counts_with_the_configured_tokenizer(tokenizer_json: str) -> None:
    """`proxy.tokenizer_path` makes the proxy charge by that tokenizer; a bad path stops it
    at start-up with the key named."""
    server = ProxyServer(parse_config(_proxy_config(tokenizer_path=tokenizer_json)),
                         gate=None)  # type: ignore[arg-type]
    assert server.counter.count_text("hello world") == 2
    default = ProxyServer(parse_config(_proxy_config()), gate=None)  # type: ignore[arg-type]
    assert default.counter.count_text("hello world") == len("hello world")
    with pytest.raises(ConfigError, match=r"proxy\.tokenizer_path"):
        ProxyServer(parse_config(_proxy_config(tokenizer_path="/nonexistent/tokenizer.json")),
                    gate=None)  # type: ignore[arg-type]
