"""Replace a small state file atomically: readers (`fleetd status`, `fleetd report`, another
process) see the old file or the new one, never half of either; and read one back as its
versioned model. Blocking: call them in a thread."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from fleetd.protocol.errors import ProtocolError

M = TypeVar("M", bound=BaseModel)


def write_atomically(path: Path, data: bytes, *, mode: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=path.suffix, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_model(path: Path, model: type[M]) -> M | None:
    """The file as ``model``; None when it does not exist; ProtocolError naming the file when it
    is not a valid one (a newer schema, a half-edited file, garbage)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return model.model_validate(json.loads(raw))
    except (ValueError, ValidationError) as exc:
        raise ProtocolError(f"{path}: not a valid {model.__name__}: {exc}") from exc
