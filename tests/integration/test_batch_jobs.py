"""Batch jobs end to end: the unmodified openai SDK against `borrowd batch serve`, workers
through the real proxy in front of `borrowd emulate`, state in a real redis-server.

After every fault (a worker SIGKILLed mid-item, the proxy SIGKILLed mid-stream, the budget
cut to zero twice, Redis restarted, a cancel, a deadline passed)
each custom_id appears exactly once across the output and error files.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.batch_stack import (
    BatchStack,
    batch_stack,
    chat_lines,
    result_ids,
    wait_terminal,
)
from tests.support.daemon_harness import borrowd_command
from tests.support.servers import wait_until

openai = pytest.importorskip("openai", reason="the openai SDK is part of the vllm extra")

pytestmark = pytest.mark.integration

KEY = "sk-etl"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BatchStack]:
    """Redis (append-only file, fsync always), one emulated replica (10x real time), the
    proxy and the batch API."""
    with batch_stack(tmp_path_factory.mktemp("batch"),
                     redis_args=("--appendonly", "yes", "--appendfsync", "always"),
                     serve_overrides={"max_file_bytes": 64 * 1024}) as running:
        yield running


@pytest.fixture
def client(stack: BatchStack) -> Iterator:
    """An openai SDK client of the batch API; the test's workers stop after it."""
    sdk = openai.OpenAI(base_url=stack.api_url, api_key=KEY, max_retries=0)
    yield sdk
    for worker in stack.workers:
        worker.stop()
    stack.workers.clear()
    stack.restore_budget()


def _submit(client, data: bytes, **metadata: str):
    uploaded = client.files.create(file=("input.jsonl", data), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                 completion_window="24h", metadata=metadata or None)


def _lines(client, file_id: str | None) -> list[str]:
    if file_id is None:
        return []
    return [line for line in client.files.content(file_id).text.split("\n") if line.strip()]


def _exactly_once(client, batch, count: int, prefix: str = "item") -> tuple[list, list]:
    """Every custom_id once across the output and error files; their parsed lines."""
    outputs = _lines(client, batch.output_file_id)
    errors = _lines(client, batch.error_file_id)
    ids = result_ids(outputs) + result_ids(errors)
    assert sorted(ids) == sorted(f"{prefix}-{i}" for i in range(count))
    assert batch.request_counts.total == count
    assert batch.request_counts.completed == len(outputs)
    assert batch.request_counts.failed == len(errors)
    return [json.loads(x) for x in outputs], [json.loads(x) for x in errors]


def _whole(outputs: list[dict], max_tokens: int) -> None:
    """Each output is one response of exactly max_tokens tokens: nothing lost or repeated."""
    for line in outputs:
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200
        assert body["usage"]["completion_tokens"] == max_tokens
        assert len(body["choices"][0]["message"]["content"].split()) == max_tokens
        assert body["choices"][0]["finish_reason"] == "length"


def test_sdk_round_trip_figures_and_idempotent_resubmit(stack: BatchStack, client) -> None:
    """files.create, batches.create/retrieve, files.content work unchanged; a re-submitted
    file runs nothing again."""
    stack.start_worker("w-roundtrip")
    batch = _submit(client, chat_lines(12, 20))
    assert batch.status in ("validating", "in_progress")
    done = wait_terminal(client, batch.id, 20)
    assert done.status == "completed"
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    outputs, errors = _exactly_once(client, done, 12)
    assert errors == []
    _whole(outputs, 20)
    figures = done.model_extra["borrowd"]
    assert figures["kept_tokens"] == 12 * 20
    assert figures["items_per_hour"] > 0 and figures["cost_per_item"] > 0
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"

    again = wait_terminal(client, _submit(client, chat_lines(12, 20)).id, 10)
    assert again.status == "completed"
    assert again.model_extra["borrowd"]["attempts"] == 0
    _exactly_once(client, again, 12)
    assert any(b.id == again.id for b in client.batches.list().data)
    metrics = wait_until(lambda: _metrics(stack, done.id), 5, "job figures in /metrics")
    assert "borrowd_batch_tenant_completed_items" in metrics

    status = json.loads(_cli(stack, "status"))
    assert status["tenants"]["etl"]["completed"] == 12
    assert {b["id"] for b in status["batches"]} >= {done.id, again.id}
    assert sorted(result_ids(_cli(stack, "results", done.id).splitlines())) == sorted(
        f"item-{i}" for i in range(12))


def _cli(stack: BatchStack, *args: str) -> str:
    """Run `borrowd batch ARGS` against the stack's API; its stdout."""
    proc = subprocess.run([borrowd_command(), "batch", *args, "--url",
                           stack.api_url.removesuffix("/v1"), "--api-key", KEY],
                          capture_output=True, text=True, timeout=30, check=True)
    return proc.stdout


def _metrics(stack: BatchStack, batch_id: str) -> str:
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.serve.port}/metrics") as resp:
        text = resp.read().decode()
    return text if f'borrowd_batch_job_items_per_hour{{job="{batch_id}"' in text else ""


def _job_field(stack: BatchStack, batch_id: str, name: str) -> int:
    client = stack.redis_client()
    try:
        return int(client.hget(f"borrowd:batch:{{{batch_id}}}:job", name) or 0)
    finally:
        client.close()


def test_worker_killed_mid_item_is_reclaimed_and_resumed(stack: BatchStack, client) -> None:
    """A SIGKILLed worker's items are reclaimed by another and finished from their
    checkpoints: each custom_id once, each response whole."""
    victim = stack.start_worker("w-victim", concurrency=4)
    batch = _submit(client, chat_lines(6, 300, "kill"))
    wait_until(lambda: _job_field(stack, batch.id, "generated_tokens") >= 64, 15,
               "the victim to checkpoint progress", interval_s=0.05)
    victim.kill()
    stack.start_worker("w-heir", concurrency=4)
    done = wait_terminal(client, batch.id, 30)
    assert done.status == "completed"
    outputs, errors = _exactly_once(client, done, 6, "kill")
    assert errors == []
    _whole(outputs, 300)
    figures = done.model_extra["borrowd"]
    assert figures["reclaimed"] >= 1
    assert figures["resumes"] >= 1


def test_budget_cut_to_zero_twice_resumes_without_redo(stack: BatchStack, client) -> None:
    """Two cuts revoke the streams in flight; each item resumes from its partial output,
    so every response is whole and nothing is redone."""
    stack.start_worker("w-cut", concurrency=6)
    batch = _submit(client, chat_lines(6, 300, "cut"))
    for cut in range(2):
        floor = _job_field(stack, batch.id, "generated_tokens") + 32
        wait_until(lambda f=floor: _job_field(stack, batch.id, "generated_tokens") >= f, 15,
                   f"progress before cut {cut + 1}", interval_s=0.05)
        stack.cut_budget()
        wait_until(lambda c=cut: _job_field(stack, batch.id, "revocations") > c, 5,
                   f"cut {cut + 1} to revoke", interval_s=0.05)
        time.sleep(0.3)
        stack.restore_budget()
    done = wait_terminal(client, batch.id, 30)
    outputs, errors = _exactly_once(client, done, 6, "cut")
    assert errors == []
    _whole(outputs, 300)
    figures = done.model_extra["borrowd"]
    assert figures["revocations"] >= 2
    assert figures["rate_limited"] >= 1
    assert figures["redone_tokens"] == 0
    assert figures["kept_tokens"] == 6 * 300


def test_cancelled_batch_lists_every_item_once(stack: BatchStack, client) -> None:
    """Cancel mid-run: cancelling, then cancelled; unfinished items are batch_cancelled."""
    stack.start_worker("w-cancel", concurrency=2)
    batch = _submit(client, chat_lines(20, 200, "cancel"))
    wait_until(lambda: _job_field(stack, batch.id, "generated_tokens") > 0, 15,
               "the batch to start", interval_s=0.05)
    assert client.batches.cancel(batch.id).status == "cancelling"
    done = wait_terminal(client, batch.id, 15)
    assert done.status == "cancelled"
    assert done.cancelling_at and done.cancelled_at
    _outputs, errors = _exactly_once(client, done, 20, "cancel")
    assert errors and all(e["error"]["code"] == "batch_cancelled" for e in errors)


def test_proxy_killed_mid_stream_items_resume(stack: BatchStack, client) -> None:
    """Streams broken by a SIGKILLed proxy resume from the text received once it is back."""
    stack.start_worker("w-proxy", concurrency=6)
    batch = _submit(client, chat_lines(6, 300, "proxy"))
    wait_until(lambda: _job_field(stack, batch.id, "generated_tokens") >= 64, 15,
               "progress before the proxy dies", interval_s=0.05)
    stack.restart_proxy()
    done = wait_terminal(client, batch.id, 30)
    outputs, errors = _exactly_once(client, done, 6, "proxy")
    assert errors == []
    _whole(outputs, 300)
    assert done.model_extra["borrowd"]["resumes"] >= 1


def test_job_that_cannot_finish_says_so_and_expires(stack: BatchStack, client) -> None:
    """With nothing carried the job is flagged at risk early; at its deadline it expires and
    every item is in the error file as batch_expired."""
    stack.cut_budget()
    stack.start_worker("w-expire", concurrency=2)
    uploaded = client.files.create(file=("in.jsonl", chat_lines(5, 50, "late")),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="4s")  # type: ignore[arg-type]
    flagged = wait_until(lambda: client.batches.retrieve(batch.id).model_extra["borrowd"]
                         ["at_risk"], 3.5, "the at-risk flag", interval_s=0.1)
    assert flagged is True
    done = wait_terminal(client, batch.id, 10)
    assert done.status == "expired" and done.expired_at
    _outputs, errors = _exactly_once(client, done, 5, "late")
    assert [e["error"]["code"] for e in errors] == ["batch_expired"] * 5


def test_redis_restart_mid_job_loses_and_duplicates_nothing(stack: BatchStack,
                                                             client) -> None:
    """State lives in Redis: SIGKILLed and started again on its append-only file mid-job,
    it costs time, not items; every response is whole."""
    stack.start_worker("w-aof", concurrency=6)
    batch = _submit(client, chat_lines(6, 300, "aof"))
    wait_until(lambda: _job_field(stack, batch.id, "generated_tokens") >= 64, 15,
               "progress before the restart", interval_s=0.05)
    stack.restart_redis()
    done = wait_terminal(client, batch.id, 40)
    assert done.status == "completed"
    outputs, errors = _exactly_once(client, done, 6, "aof")
    assert errors == []
    _whole(outputs, 300)


_GOOD = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "m", "messages": [{"role": "user", "content": "x"}]}})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_GOOD + "\n{not json", "line 2: line: is not valid JSON"),
        (_GOOD + "\n" + _GOOD, "line 2: custom_id: 'a' duplicates line 1"),
        (_GOOD + "\n" + _GOOD.replace('"a"', '"b"').replace("chat/completions", "embeddings"),
         "line 2: url: '/v1/embeddings' is not supported"),
        ((_GOOD + "\n") * 1 + "\n".join(_GOOD.replace('"a"', f'"x{i}"') for i in range(800)),
         "file: is over the limit of 65536 bytes"),
    ],
    ids=["malformed", "duplicate-custom-id", "unsupported-url", "oversized"],
)
def test_bad_input_is_refused_at_upload(stack: BatchStack, client, data: str,
                                        message: str) -> None:
    """The upload is refused with a 400 naming the line and field."""
    with pytest.raises(openai.BadRequestError) as info:
        client.files.create(file=("bad.jsonl", data.encode()), purpose="batch")
    assert message in info.value.message


def test_lines_for_another_endpoint_fail_the_batch_at_create(client) -> None:
    """A batch whose lines use another endpoint fails with the line and field in errors."""
    uploaded = client.files.create(file=("in.jsonl", _GOOD.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                  completion_window="24h")
    assert batch.status == "failed" and batch.failed_at
    error = batch.errors.data[0]
    assert (error.line, error.param) == (1, "url")


def test_cli_submit_of_a_bad_file_is_one_line_and_exit_2(stack: BatchStack,
                                                         tmp_path: Path) -> None:
    """`borrowd batch submit` of a malformed file: one line naming line and field, code 2."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(_GOOD + "\n" + _GOOD)
    with pytest.raises(subprocess.CalledProcessError) as info:
        _cli(stack, "submit", str(bad))
    proc = info.value
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "line 2: custom_id" in proc.stderr
