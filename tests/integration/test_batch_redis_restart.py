"""Batch jobs across a Redis restart: redis-server SIGKILLed mid-job and started again on
its append-only file; workers, the API and the proxy reconnect, and every custom_id
appears exactly once with a whole response."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.support.batch_stack import batch_stack, chat_lines, result_ids, wait_terminal
from tests.support.servers import wait_until

openai = pytest.importorskip("openai", reason="the openai SDK is part of the vllm extra")

pytestmark = pytest.mark.integration


def test_redis_restart_mid_job_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    """State lives in Redis (AOF, fsync always): a restart mid-job costs time, not items."""
    with batch_stack(tmp_path, redis_args=("--appendonly", "yes",
                                           "--appendfsync", "always")) as stack:
        client = openai.OpenAI(base_url=stack.api_url, api_key="sk-etl", max_retries=0)
        stack.start_worker("w-aof", concurrency=6)
        uploaded = client.files.create(file=("in.jsonl", chat_lines(6, 300, "aof")),
                                       purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id,
                                      endpoint="/v1/chat/completions", completion_window="24h")
        redis_client = stack.redis_client()
        job = f"borrowd:batch:{{{batch.id}}}:job"
        wait_until(lambda: int(redis_client.hget(job, "generated_tokens") or 0) >= 64, 15,
                   "progress before the restart", interval_s=0.05)
        redis_client.close()
        stack.restart_redis()
        time.sleep(0.2)
        done = wait_terminal(client, batch.id, 40)
        assert done.status == "completed"
        outputs = [json.loads(x) for x in client.files.content(done.output_file_id).text
                   .split("\n") if x.strip()]
        assert sorted(result_ids([json.dumps(o) for o in outputs])) == sorted(
            f"aof-{i}" for i in range(6))
        assert done.error_file_id is None
        for line in outputs:
            assert line["response"]["body"]["usage"]["completion_tokens"] == 300
