"""The one logging setup of every borrowd process: structlog, one JSON object per line, stderr.

structlog events (daemon, gate, store) and stdlib `logging` records (the proxy, aiohttp,
asyncio) go through the same processors (level, UTC time, secrets redacted) to stderr, so
stdout carries only what a command prints as its result (`borrowd status --json`).
"""

from __future__ import annotations

import io
import logging
import sys
from typing import TextIO, cast

import structlog
from borrowd.adapters.redact import redact_event

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}


class _Stderr(io.TextIOBase):
    """Whatever `sys.stderr` is when a line is written (a test or a host may replace it)."""

    def write(self, text: str) -> int:
        """Write to the current stderr."""
        return sys.stderr.write(text)

    def flush(self) -> None:
        """Flush the current stderr."""
        sys.stderr.flush()


def configure_logging(level: str = "info", stream: TextIO | None = None) -> None:
    """Send structlog and stdlib logging at `level` and above to `stream` (default: stderr)."""
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    out = cast(TextIO, _Stderr()) if stream is None else stream
    stamped: list[structlog.typing.Processor] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            *stamped,
            structlog.processors.format_exc_info,
            redact_event,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*stamped, structlog.stdlib.add_logger_name],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            redact_event,
            structlog.processors.JSONRenderer(),
        ],
    ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(LEVELS[level])
