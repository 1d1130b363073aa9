"""A local record of this writer's open multipart uploads, so a restarted agent can abort them.

S3 keeps the parts of an upload that was never completed or aborted (and bills for them). After a
crash or SIGKILL the process that knew the UploadId is gone; ListMultipartUploads shows the upload,
but not who started it (moto reports neither initiator nor a real start time). So each upload is
written here right after CreateMultipartUpload and removed after Complete/Abort; the next run
aborts whatever is left. Uploads orphaned by a node that never comes back are caught by the
age rule in the uploader instead (its disk, and this ledger, went with it).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from fleetd.shared.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    key: str
    upload_id: str
    pid: int

    def owner_alive(self) -> bool:
        """Whether the process that started the upload still runs (then it is not stale).
        This process's own entries count as dead: it knows which uploads it has in flight."""
        if self.pid == os.getpid():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class UploadLedger:
    """One small JSON file per open upload under ``directory``. Blocking: call via to_thread."""

    def __init__(self, directory: Path):
        self.directory = directory

    def _path(self, upload_id: str) -> Path:
        return self.directory / (hashlib.sha1(upload_id.encode()).hexdigest() + ".json")

    def record(self, key: str, upload_id: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self._path(upload_id).with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "upload_id": upload_id, "pid": os.getpid()}))
        os.replace(tmp, self._path(upload_id))

    def forget(self, upload_id: str) -> None:
        self._path(upload_id).unlink(missing_ok=True)

    def entries(self) -> list[LedgerEntry]:
        if not self.directory.is_dir():
            return []
        out = []
        for p in sorted(self.directory.glob("*.json")):
            try:
                d = json.loads(p.read_text())
                out.append(LedgerEntry(str(d["key"]), str(d["upload_id"]), int(d["pid"])))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("upload_ledger_entry_unreadable", path=str(p), error=str(exc))
                p.unlink(missing_ok=True)
        return out
