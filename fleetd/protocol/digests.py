"""File checksums as checkpoint manifests record them, and the incremental digest that checks them.

Kept apart from the layout (fleetd/protocol/checkpoints.py): hashing is its own job, used by the
uploader as it reads parts and by the restorer as it verifies them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from fleetd.protocol.errors import ProtocolError

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_CRC32C_HEX = re.compile(r"^[0-9a-f]{8}$")


class Checksum(BaseModel):
    """Checksum of a whole file, lowercase hex.

    - ``sha256``: SHA-256 of the file (files fleetd uploads in a single PUT).
    - ``sha256-composite``: the file hashed in parts of ``part_size`` bytes (the last may be
      shorter): SHA-256 of the concatenated raw SHA-256 digests of the parts (the same
      construction as S3's COMPOSITE checksums). Parts hash independently, so an uploader hashes
      them in parallel as it reads them, and never reads a file twice.
    - ``crc32c``: accepted from other writers; this build cannot verify it (Digest says so).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    algorithm: Literal["sha256", "sha256-composite", "crc32c"]
    value: str
    part_size: Annotated[int, Field(ge=1)] | None = None

    @field_validator("value")
    @classmethod
    def _hex(cls, v: str, info: ValidationInfo) -> str:
        pattern = _CRC32C_HEX if info.data.get("algorithm") == "crc32c" else _SHA256_HEX
        if not pattern.match(v):
            raise ValueError(f"not a lowercase hex {info.data.get('algorithm')} digest")
        return v

    @model_validator(mode="after")
    def _part_size(self) -> Checksum:
        if (self.algorithm == "sha256-composite") != (self.part_size is not None):
            raise ValueError("part_size is required for sha256-composite and only for it")
        return self

    @classmethod
    def sha256(cls, digest: bytes) -> Checksum:
        return cls(algorithm="sha256", value=digest.hex())

    @classmethod
    def sha256_composite(cls, part_digests: Iterable[bytes], part_size: int) -> Checksum:
        joined = b"".join(part_digests)
        return cls(algorithm="sha256-composite", value=hashlib.sha256(joined).hexdigest(), part_size=part_size)


class Digest:
    """Incremental checksum of a file in a manifest entry's algorithm: feed the bytes in order.

    ``Digest.like(entry.checksum)`` hashes the way the entry was made; ``checksum()`` is then equal
    to it exactly when the bytes are the same. Blocking CPU work: run big updates in a thread."""

    def __init__(self, algorithm: str, part_size: int | None = None):
        if algorithm not in ("sha256", "sha256-composite"):
            raise ProtocolError(f"{algorithm} checksums cannot be verified by this build")
        self._algorithm = algorithm
        self._part_size = part_size
        self._part = hashlib.sha256()
        self._left = part_size or 0  # bytes still to go into the current part
        self._digests: list[bytes] = []

    @classmethod
    def like(cls, checksum: Checksum) -> Digest:
        return cls(checksum.algorithm, checksum.part_size)

    def update(self, data: bytes | bytearray | memoryview) -> None:
        if self._part_size is None:
            self._part.update(data)
            return
        view = memoryview(data)
        while view:
            take = view[: self._left]
            self._part.update(take)
            self._left -= len(take)
            view = view[len(take) :]
            if self._left == 0:
                self._digests.append(self._part.digest())
                self._part = hashlib.sha256()
                self._left = self._part_size

    def checksum(self) -> Checksum:
        if self._part_size is None:
            return Checksum.sha256(self._part.digest())
        digests = list(self._digests)
        if self._left != self._part_size or not digests:  # a last, shorter part (or empty file)
            digests.append(self._part.digest())
        return Checksum.sha256_composite(digests, self._part_size)
