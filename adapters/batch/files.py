"""Files of the Batch API on local disk: written whole, fsynced, renamed into place.

A file is `DATA_DIR/files/ID.jsonl`; a crash leaves either no file or the whole file
(write to a temporary name, fsync, rename, fsync the directory).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from borrowd.models.errors import InputError

_ID = re.compile(r"^file-[A-Za-z0-9_-]{1,80}$")


class FileDir:
    """The directory that holds the API's files."""

    def __init__(self, data_dir: str | Path) -> None:
        self.root = Path(data_dir) / "files"
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        """Where a file lives; `InputError` for an id that is not one of ours."""
        if not _ID.match(file_id):
            raise InputError(f"file id {file_id!r} is malformed")
        return self.root / f"{file_id}.jsonl"

    def write(self, file_id: str, chunks: Iterable[bytes]) -> int:
        """Write a file durably from `chunks`; its size in bytes."""
        final = self.path(file_id)
        tmp = final.with_suffix(".tmp")
        size = 0
        with open(tmp, "wb") as out:
            for chunk in chunks:
                out.write(chunk)
                size += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, final)
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return size

    def read(self, file_id: str) -> bytes:
        """A file's bytes."""
        return self.path(file_id).read_bytes()
