"""`borrowd batch`: batch jobs in the OpenAI Batch format on borrowed capacity.

`serve` runs the Files + Batches API, `worker` runs items through the proxy; `submit`,
`status`, `results` and `cancel` are clients of the API (`--url`, default
$BORROWD_BATCH_URL then http://127.0.0.1:8200; `--api-key`, default $BORROWD_BATCH_API_KEY).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from borrowd.models.batch.input import SUPPORTED_URLS
from borrowd.models.errors import BorrowdError, InputError

DEFAULT_URL = "http://127.0.0.1:8200"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `batch` with its subcommands."""
    batch = subparsers.add_parser("batch", help="batch jobs (OpenAI Batch API) on borrowed GPUs")
    sub = batch.add_subparsers(dest="batch_command", metavar="SUBCOMMAND", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI Files + Batches API")
    serve.add_argument("--config", required=True, help="batch TOML file")
    serve.set_defaults(func=cmd_serve)

    worker = sub.add_parser("worker", help="run batch items through the proxy")
    worker.add_argument("--config", required=True, help="batch TOML file")
    worker.add_argument("--concurrency", type=int, default=None,
                        help="items in flight (default: worker.concurrency)")
    worker.add_argument("--id", default=None, help="consumer name (default: random)")
    worker.set_defaults(func=cmd_worker)

    submit = sub.add_parser("submit", help="upload a JSONL file and create a batch")
    _client_args(submit)
    submit.add_argument("file", help="input JSONL file (OpenAI Batch format)")
    submit.add_argument("--endpoint", default="/v1/chat/completions", choices=SUPPORTED_URLS)
    submit.add_argument("--window", default="24h", help="completion window (24h, 90m, ...)")
    submit.add_argument("--job-key", default=None,
                        help="idempotency key: completed custom_ids under it are not rerun")
    submit.set_defaults(func=cmd_submit)

    status = sub.add_parser("status", help="a batch's status and figures (JSON), or all")
    _client_args(status)
    status.add_argument("batch_id", nargs="?", default=None)
    status.set_defaults(func=cmd_status)

    results = sub.add_parser("results", help="download a batch's output and error files")
    _client_args(results)
    results.add_argument("batch_id")
    results.add_argument("--output", default=None, help="write output lines here (else stdout)")
    results.add_argument("--errors", default=None, help="write error lines here (else stdout)")
    results.set_defaults(func=cmd_results)

    cancel = sub.add_parser("cancel", help="cancel a batch")
    _client_args(cancel)
    cancel.add_argument("batch_id")
    cancel.set_defaults(func=cmd_cancel)


def _client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=os.environ.get("BORROWD_BATCH_URL", DEFAULT_URL),
                        help="base URL of `borrowd batch serve`")
    parser.add_argument("--api-key", default=os.environ.get("BORROWD_BATCH_API_KEY"),
                        help="tenant API key (default $BORROWD_BATCH_API_KEY)")


def _until_signalled(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


def cmd_serve(args: argparse.Namespace) -> int:
    """`borrowd batch serve --config FILE`."""
    from borrowd.adapters.batch.api import BatchApi, serve
    from borrowd.adapters.batch.config import load_batch_config
    from borrowd.adapters.batch.files import FileDir
    from borrowd.adapters.batch.jobs import BatchService
    from borrowd.adapters.batch.state import BatchStore
    from borrowd.adapters.redis_conn import connect_async, redact_url, resolve_redis_url

    config = load_batch_config(args.config)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    url = resolve_redis_url(config.serve.redis_url)
    files = FileDir(config.serve.data_dir)

    async def main() -> None:
        client = connect_async(url)
        service = BatchService(BatchStore(client), files, config)
        runner = await serve(BatchApi(service), config.serve.listen_host,
                             config.serve.listen_port)
        logging.info("borrowd batch serve on %s:%d, files in %s, state in %s",
                     config.serve.listen_host, config.serve.listen_port,
                     config.serve.data_dir, redact_url(url))
        stop = asyncio.Event()
        _until_signalled(stop)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
            await client.aclose()

    asyncio.run(main())
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    """`borrowd batch worker --config FILE`."""
    import dataclasses

    from borrowd.adapters.batch.config import load_batch_config
    from borrowd.adapters.batch.state import BatchStore
    from borrowd.adapters.batch.worker import Worker
    from borrowd.adapters.redis_conn import connect_async, redact_url, resolve_redis_url

    config = load_batch_config(args.config)
    if args.concurrency is not None:
        if args.concurrency < 1:
            raise InputError(f"--concurrency must be >= 1, got {args.concurrency}")
        config = dataclasses.replace(config, worker=dataclasses.replace(
            config.worker, concurrency=args.concurrency))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    url = resolve_redis_url(config.serve.redis_url)

    async def main() -> None:
        client = connect_async(url)
        worker = Worker(BatchStore(client), config, consumer=args.id)
        logging.info("borrowd batch worker %s: proxy %s, %d slots, state in %s",
                     worker.consumer, config.worker.proxy_url, config.worker.concurrency,
                     redact_url(url))
        stop = asyncio.Event()
        _until_signalled(stop)
        try:
            await worker.run(stop)
        finally:
            await client.aclose()

    asyncio.run(main())
    return 0


def _call(args: argparse.Namespace, method: str, path: str, body: bytes | None = None,
          content_type: str = "application/json") -> bytes:
    if not args.api_key:
        raise InputError("--api-key (or $BORROWD_BATCH_API_KEY) is required")
    request = urllib.request.Request(args.url.rstrip("/") + path, data=body, method=method,
                                     headers={"Authorization": f"Bearer {args.api_key}",
                                              "Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.read()
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise BorrowdError(f"{method} {path}: {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise BorrowdError(f"batch API at {args.url} unreachable: {reason}") from None


def _json_call(args: argparse.Namespace, method: str, path: str,
               body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    return json.loads(_call(args, method, path, data))


def cmd_submit(args: argparse.Namespace) -> int:
    """`borrowd batch submit FILE`: upload, create, print the batch object."""
    path = Path(args.file)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: {exc.strerror or exc}") from None
    boundary = uuid.uuid4().hex
    multipart = (
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
        f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
        f"filename=\"{path.name}\"\r\nContent-Type: application/jsonl\r\n\r\n"
    ).encode() + data + f"\r\n--{boundary}--\r\n".encode()
    uploaded = json.loads(_call(args, "POST", "/v1/files", multipart,
                                f"multipart/form-data; boundary={boundary}"))
    request: dict[str, Any] = {"input_file_id": uploaded["id"], "endpoint": args.endpoint,
                               "completion_window": args.window}
    if args.job_key:
        request["metadata"] = {"borrowd_job_key": args.job_key}
    _print(_json_call(args, "POST", "/v1/batches", request))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """`borrowd batch status [ID]`: one batch, or every batch and the tenant's figures."""
    if args.batch_id:
        _print(_json_call(args, "GET", f"/v1/batches/{args.batch_id}"))
    else:
        _print({"batches": _json_call(args, "GET", "/v1/batches?limit=100")["data"],
                "tenants": _json_call(args, "GET", "/v1/borrowd/tenants")})
    return 0


def cmd_results(args: argparse.Namespace) -> int:
    """`borrowd batch results ID`: the output and error lines."""
    batch = _json_call(args, "GET", f"/v1/batches/{args.batch_id}")
    for key, target in (("output_file_id", args.output), ("error_file_id", args.errors)):
        file_id = batch.get(key)
        if not file_id:
            continue
        content = _call(args, "GET", f"/v1/files/{file_id}/content")
        if target:
            Path(target).write_bytes(content)
        else:
            sys.stdout.buffer.write(content)
    if not batch.get("output_file_id") and not batch.get("error_file_id"):
        raise InputError(f"batch {args.batch_id} has no result files yet "
                         f"(status {batch['status']})")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    """`borrowd batch cancel ID`."""
    _print(_json_call(args, "POST", f"/v1/batches/{args.batch_id}/cancel"))
    return 0


def _print(obj: Any) -> None:
    print(json.dumps(obj, indent=2))
