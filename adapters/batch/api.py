"""`borrowd batch serve`: the OpenAI Files + Batches HTTP API on aiohttp.

Routes: POST /v1/files (multipart: purpose=batch, file), GET /v1/files/{id},
GET /v1/files/{id}/content, POST /v1/batches, GET /v1/batches, GET /v1/batches/{id},
POST /v1/batches/{id}/cancel; borrowd's own GET /v1/borrowd/tenants (per-tenant figures),
/metrics (Prometheus) and /health. Clients authenticate with `Authorization: Bearer KEY`,
a key of a `[tenants.NAME]`; a tenant sees only its own files and batches. Errors are
OpenAI error objects naming the field (`param`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import redis
from aiohttp import BodyPartReader, web
from borrowd.adapters.batch.jobs import ApiError, BatchService, file_object
from borrowd.adapters.batch.metrics import BatchCollector
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

_TENANT = web.RequestKey("tenant", str)


class BatchApi:
    """HTTP routes over a `BatchService`, plus the monitor task that drives jobs."""

    def __init__(self, service: BatchService) -> None:
        self.service = service
        self.registry = CollectorRegistry()
        self.collector = BatchCollector()
        self.registry.register(self.collector)
        self._task: asyncio.Task | None = None

    def build_app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application(middlewares=[self._errors])
        app.router.add_post("/v1/files", self._upload)
        app.router.add_get("/v1/files/{file_id}", self._file)
        app.router.add_get("/v1/files/{file_id}/content", self._content)
        app.router.add_post("/v1/batches", self._create)
        app.router.add_get("/v1/batches", self._list)
        app.router.add_get("/v1/batches/{batch_id}", self._get)
        app.router.add_post("/v1/batches/{batch_id}/cancel", self._cancel)
        app.router.add_get("/v1/borrowd/tenants", self._tenants)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        self._task = asyncio.create_task(self._monitor())

    async def _stop(self, _app: web.Application) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _monitor(self) -> None:
        interval_s = self.service.config.serve.monitor_interval_s
        while True:
            try:
                await self.service.monitor_once()
                self.collector.refresh(await self._snapshot())
            except asyncio.CancelledError:
                raise
            except Exception:  # Redis away, a file write failed: log and try next pass
                log.exception("batch monitor pass failed")
            await asyncio.sleep(interval_s)

    async def _snapshot(self) -> tuple[list[dict], dict[str, dict]]:
        jobs, _more = await self.service.store.jobs(None, None, 200)
        return ([self.service.batch_object(j) for j in jobs],
                await self.service.tenant_figures())

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            if request.path.startswith("/v1/"):
                request[_TENANT] = self._tenant(request)
            return await handler(request)
        except ApiError as exc:
            return _error(exc.status, str(exc), exc.param, exc.code)
        except redis.RedisError as exc:
            log.warning("batch state store unreachable: %r", exc)
            return _error(503, "batch state store unreachable, retry later", None, None)

    def _tenant(self, request: web.Request) -> str:
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        tenant = self.service.config.tenant_of_key(key.strip()) if scheme.lower() == "bearer" \
            else None
        if tenant is None:
            raise ApiError(401, "missing or unknown API key (Authorization: Bearer KEY)")
        return tenant.name

    async def _upload(self, request: web.Request) -> web.Response:
        if not request.content_type.startswith("multipart/"):
            raise ApiError(400, "POST /v1/files takes multipart/form-data (purpose, file)",
                           "file")
        limit = self.service.config.serve.max_file_bytes
        purpose, filename, data = None, "", b""
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "purpose":
                purpose = (await part.read()).decode(errors="replace")
            elif part.name == "file":
                filename = part.filename or ""
                data = await _read_limited(part, limit)
        if purpose is None:
            raise ApiError(400, "purpose is required", "purpose")
        if not data:
            raise ApiError(400, "file is required and must not be empty", "file")
        return web.json_response(await self.service.upload(request[_TENANT], filename,
                                                           purpose, data))

    async def _file(self, request: web.Request) -> web.Response:
        record = await self.service.file(request[_TENANT], request.match_info["file_id"])
        return web.json_response(file_object(record))

    async def _content(self, request: web.Request) -> web.Response:
        file_id = request.match_info["file_id"]
        await self.service.file(request[_TENANT], file_id)
        return web.Response(body=await asyncio.to_thread(self.service.content, file_id),
                            content_type="application/octet-stream")

    async def _create(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "body must be a JSON object", "body") from None
        if not isinstance(body, dict):
            raise ApiError(400, "body must be a JSON object", "body")
        return web.json_response(await self.service.create(request[_TENANT], body))

    async def _list(self, request: web.Request) -> web.Response:
        try:
            limit = int(request.query.get("limit", "20"))
        except ValueError:
            raise ApiError(400, "limit must be an integer", "limit") from None
        if not 1 <= limit <= 100:
            raise ApiError(400, "limit must be 1-100", "limit")
        return web.json_response(await self.service.page(request[_TENANT],
                                                         request.query.get("after"), limit))

    async def _get(self, request: web.Request) -> web.Response:
        return web.json_response(await self.service.get(request[_TENANT],
                                                        request.match_info["batch_id"]))

    async def _cancel(self, request: web.Request) -> web.Response:
        return web.json_response(await self.service.cancel(request[_TENANT],
                                                           request.match_info["batch_id"]))

    async def _tenants(self, request: web.Request) -> web.Response:
        figures = await self.service.tenant_figures()
        return web.json_response({request[_TENANT]: figures[request[_TENANT]]})

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok\n")


async def _read_limited(part: BodyPartReader, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while chunk := await part.read_chunk(1 << 20):
        size += len(chunk)
        if size > limit:
            raise ApiError(400, f"file: is over the limit of {limit} bytes", "file",
                           "invalid_batch_input")
        chunks.append(chunk)
    return b"".join(chunks)


def _error(status: int, message: str, param: str | None, code: str | None) -> web.Response:
    kind = {401: "authentication_error", 404: "not_found_error",
            503: "service_unavailable"}.get(status, "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.Response(status=status, body=json.dumps(body), content_type="application/json")


async def serve(api: BatchApi, host: str, port: int) -> web.AppRunner:
    """Start the API on host:port; returns the runner to clean up."""
    runner = web.AppRunner(api.build_app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
