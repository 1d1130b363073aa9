"""Pack a job's workdir into the archive the nodes run (format: fleetd/protocol/job_code.py).

The archive's bytes depend only on what a node needs: each file's path, contents and exec bit.
Timestamps, owners and the order the file system lists a folder in are left out, so the same
tree always has the same digest and an unchanged workdir is never uploaded twice.

What is left out: ``.fleetdignore`` if the workdir has one, else its ``.gitignore`` (git's
pattern rules, via pathspec), plus what never belongs on a node (``.git/``, virtualenvs,
bytecode). Symbolic links are skipped and listed: a link's target may not exist on a node.
"""

from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pathspec

from fleetd.protocol.job_code import MAX_ARCHIVE_BYTES, digest_of

ALWAYS_IGNORED = (".git/", ".hg/", ".venv/", "venv/", "__pycache__/", "*.pyc", ".mypy_cache/", ".pytest_cache/")
IGNORE_FILES = (".fleetdignore", ".gitignore")
SHADOWING = frozenset({"agent", "agent.py", "fleetd", "fleetd.py"})


class PackError(ValueError):
    """The workdir cannot be shipped as it is (missing, empty, too big)."""


@dataclass(frozen=True, slots=True)
class Packed:
    data: bytes
    digest: str
    files: tuple[str, ...]
    skipped_links: tuple[str, ...] = ()
    ignore_file: str | None = None


def _ignore_spec(workdir: Path) -> tuple[pathspec.GitIgnoreSpec, str | None]:
    lines = list(ALWAYS_IGNORED)
    used = None
    for name in IGNORE_FILES:
        f = workdir / name
        if f.is_file():
            lines += f.read_text(encoding="utf-8").splitlines()
            used = name
            break
    return pathspec.GitIgnoreSpec.from_lines(lines), used


def _walk(workdir: Path, spec: pathspec.GitIgnoreSpec) -> tuple[list[str], list[str]]:
    files: list[str] = []
    links: list[str] = []
    for root, dirs, names in os.walk(workdir):
        rel_root = Path(root).relative_to(workdir)
        # Prune ignored folders before descending (a venv holds tens of thousands of files).
        dirs[:] = sorted(d for d in dirs if not spec.match_file(f"{(rel_root / d).as_posix()}/"))
        for name in sorted(names):
            rel = (rel_root / name).as_posix()
            if spec.match_file(rel):
                continue
            if (Path(root) / name).is_symlink():
                links.append(rel)
            else:
                files.append(rel)
        for d in list(dirs):
            if (Path(root) / d).is_symlink():
                links.append((rel_root / d).as_posix())
                dirs.remove(d)
    return sorted(files), sorted(links)


def pack(workdir: Path) -> Packed:
    """Blocking (reads every file): call it in a thread from async code."""
    if not workdir.is_dir():
        raise PackError(f"job workdir {workdir} is not a folder")
    spec, ignore_file = _ignore_spec(workdir)
    files, links = _walk(workdir, spec)
    if not files:
        raise PackError(f"job workdir {workdir} has no files to ship (all ignored?)")
    shadows = sorted({f.split("/")[0] for f in files} & SHADOWING)
    if shadows:
        # The job's folder comes first on its workers' import path: these would hide fleetd's
        # own packages there, and the workers would fail with an ImportError naming neither.
        raise PackError(f"job workdir {workdir} has {', '.join(shadows)} at its top: rename it")
    raw = io.BytesIO()
    # mtime=0 and no file name in the gzip header: the same tree gives the same bytes.
    with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for rel in files:
                path = workdir / rel
                st = path.stat()
                info = tarfile.TarInfo(rel)
                info.size = st.st_size
                info.mode = 0o755 if st.st_mode & stat.S_IXUSR else 0o644
                info.mtime = 0
                with path.open("rb") as fh:
                    tar.addfile(info, fh)
                if raw.tell() > MAX_ARCHIVE_BYTES:
                    raise PackError(
                        f"job workdir {workdir} packs to over {MAX_ARCHIVE_BYTES >> 20} MiB: "
                        "leave data and checkpoints out (.fleetdignore) and fetch them from the job"
                    )
    data = raw.getvalue()
    return Packed(data, digest_of(data), tuple(files), tuple(links), ignore_file)
