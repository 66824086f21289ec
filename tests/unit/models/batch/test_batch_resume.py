"""Resume, not redo: continuation requests, chunk accumulation, merged responses."""

from __future__ import annotations

from borrowd.models.batch.input import CHAT_URL, COMPLETIONS_URL
from borrowd.models.batch.resume import ChunkAccumulator, Segment, merge_segments, resume_body

CHAT = {"model": "m", "messages": [{"role": "user", "content": "summarize"}], "max_tokens": 100}


def test_chat_resume_appends_partial_assistant_message() -> None:
    """Chat continues the partial answer as vLLM's continue_final_message does."""
    body = resume_body(CHAT_URL, CHAT, " the quick", 2)
    assert body["messages"][-1] == {"role": "assistant", "content": " the quick"}
    assert body["continue_final_message"] is True
    assert body["add_generation_prompt"] is False
    assert body["max_tokens"] == 98
    assert CHAT["messages"] == [{"role": "user", "content": "summarize"}]


def test_chat_resume_extends_a_prefilled_assistant_message() -> None:
    """A request that already continues an assistant prefix gets the text added to it."""
    original = {**CHAT, "continue_final_message": True, "add_generation_prompt": False,
                "messages": [*CHAT["messages"], {"role": "assistant", "content": "Summary:"}]}
    body = resume_body(CHAT_URL, original, " short", 1)
    assert body["messages"][-1] == {"role": "assistant", "content": "Summary: short"}
    assert len(body["messages"]) == 2


def test_completions_resume_appends_text_to_prompt() -> None:
    """Completions continue from prompt + text so far, max_completion_tokens reduced too."""
    body = resume_body(COMPLETIONS_URL, {"model": "m", "prompt": ["Once"],
                                         "max_completion_tokens": 10}, " upon", 1)
    assert body["prompt"] == "Once upon"
    assert body["max_completion_tokens"] == 9


def test_resume_without_text_is_the_original_request() -> None:
    """Nothing generated yet: the request goes out unchanged."""
    assert resume_body(CHAT_URL, CHAT, "", 0) == CHAT


def test_accumulator_takes_text_usage_and_preempted_text() -> None:
    """Chunks give text and usage; a preempted chunk's borrowd_text wins."""
    acc = ChunkAccumulator(chat=True)
    acc.feed({"id": "r1", "model": "m", "created": 5,
              "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    acc.feed({"choices": [{"index": 0, "delta": {"content": " a"}}],
              "usage": {"prompt_tokens": 7, "completion_tokens": 1}})
    acc.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "preempted",
                           "borrowd_text": " a b"}],
              "usage": {"prompt_tokens": 7, "completion_tokens": 2}})
    segment = acc.segment(3)
    assert segment == Segment(" a b", 7, 2, "preempted", "r1", "m", 5)
    assert not segment.finished


def test_accumulator_counts_chunks_without_usage() -> None:
    """Without usage, tokens are the token-carrying chunks and the prompt is the estimate."""
    acc = ChunkAccumulator(chat=False)
    for text in (" x", " y", ""):
        acc.feed({"choices": [{"index": 0, "text": text}]})
    acc.feed({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    segment = acc.segment(4)
    assert (segment.text, segment.prompt_tokens, segment.completion_tokens) == (" x y", 4, 2)
    assert segment.finished


def test_merge_joins_text_and_sums_usage() -> None:
    """One response: texts joined, last finish reason, usage summed over attempts."""
    parts = [Segment(" a b", 7, 2, "preempted", "r1", "m", 5),
             Segment(" c", 9, 1, "length", "r2", "m", 6)]
    merged = merge_segments(CHAT_URL, parts, "fallback", "m", 1)
    assert merged["id"] == "r1"
    assert merged["object"] == "chat.completion"
    assert merged["choices"][0]["message"] == {"role": "assistant", "content": " a b c"}
    assert merged["choices"][0]["finish_reason"] == "length"
    assert merged["usage"] == {"prompt_tokens": 16, "completion_tokens": 3, "total_tokens": 19}
