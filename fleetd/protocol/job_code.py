"""The job's code as it travels from the control host to the nodes: one content-addressed archive.

The controller packs the job file's workdir (fleetd/jobs/pack.py) into a gzip'd tar whose bytes
depend only on the files' paths, contents and exec bits, names it by its SHA-256, and uploads it
once under the job's prefix. The digest travels in the launch template's user data with the rest
of the job (``job.code_uri``, ``job.code_digest``), so a node knows before it downloads a byte
which version it must run; the agent (agent/supervise/workspace.py) refuses an archive whose bytes
hash to anything else and unpacks it into a folder named by the digest. A node therefore runs one
version whole, never a mix, and a replacement node runs the version its template names.

Shared by both sides, so: no network, no asyncio.
"""

from __future__ import annotations

import hashlib
import io
import re
import shutil
import tarfile
from pathlib import Path, PurePosixPath

from fleetd.protocol.errors import ProtocolError

_DIGEST = re.compile(r"^[0-9a-f]{64}$")
# A job's code is source, not data: past this the user almost certainly packed a dataset or a
# checkpoint folder by mistake (say so, rather than upload gigabytes to every node).
MAX_ARCHIVE_BYTES = 512 << 20
MAX_UNPACKED_BYTES = 2 << 30


def code_key(prefix: str, job: str, digest: str) -> str:
    """Where a version lives: under the job's own prefix, beside its checkpoints
    (fleetd/protocol/checkpoints.py), so the nodes' S3 permissions and the bucket's lifecycle
    cover it. Nodes may write there too; the digest in their user data, not the bucket, is what
    they trust."""
    check_digest(digest)
    return "/".join(p for p in (prefix.strip("/"), job, "code", f"{digest}.tar.gz") if p)


def code_uri(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


def split_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> (bucket, key). Raises ProtocolError."""
    if not uri.startswith("s3://") or "/" not in uri[5:]:
        raise ProtocolError(f"job code uri {uri!r} is not s3://bucket/key")
    bucket, key = uri[5:].split("/", 1)
    if not bucket or not key:
        raise ProtocolError(f"job code uri {uri!r} is not s3://bucket/key")
    return bucket, key


def check_digest(digest: str) -> str:
    if not _DIGEST.match(digest):
        raise ProtocolError(f"job code digest {digest!r} is not 64 lowercase hex digits (SHA-256)")
    return digest


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def verify(data: bytes, digest: str) -> None:
    """Raises ProtocolError unless ``data`` is the archive ``digest`` names."""
    got = digest_of(data)
    if got != check_digest(digest):
        raise ProtocolError(f"job code archive hashes to {got[:12]}, its user data names {digest[:12]}: refused")


def _safe_member(m: tarfile.TarInfo) -> PurePosixPath:
    path = PurePosixPath(m.name)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise ProtocolError(f"job code archive member {m.name!r} points outside its folder")
    if not (m.isfile() or m.isdir()):
        # fleetd's packer writes files and folders only; anything else did not come from it.
        raise ProtocolError(f"job code archive member {m.name!r} is not a plain file or folder")
    return path


def unpack(data: bytes, dest: Path) -> int:
    """Unpack a verified archive into ``dest`` (which must not exist yet). Returns the file count.

    Members are checked before anything is written: absolute paths, ``..``, links and devices
    are refused (tarfile's "data" filter would also refuse them; checking first means a bad
    archive leaves no half-written folder)."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = tar.getmembers()
        total = 0
        for m in members:
            _safe_member(m)
            total += m.size
        if total > MAX_UNPACKED_BYTES:
            raise ProtocolError(f"job code archive unpacks to {total} bytes (limit {MAX_UNPACKED_BYTES})")
        dest.mkdir(parents=True)
        # Written by hand from the checked members, not extractall: its "data" filter is missing
        # from Pythons before 3.11.4 (Debian 12 has 3.11.2: every unpack failed with a TypeError
        # there, found by the deploy-box flow), and without it extractall would honour the
        # archive's owners and times. Modes are the packer's two (0644, or 0755 when executable).
        for m in members:
            target = dest.joinpath(*_safe_member(m).parts)
            if m.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(m)
            assert source is not None  # a regular file (checked above)
            with source, open(target, "wb") as out:
                shutil.copyfileobj(source, out)
            target.chmod(0o755 if m.mode & 0o100 else 0o644)
    return sum(1 for m in members if m.isfile())
