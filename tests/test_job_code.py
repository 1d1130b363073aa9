"""The job's code on its way to the nodes: packed the same way every time (fleetd/jobs/pack.py),
refused unless its digest matches, unpacked only inside its folder (fleetd/protocol/job_code.py)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from fleetd.jobs.pack import PackError, pack
from fleetd.protocol.errors import ProtocolError
from fleetd.protocol.job_code import code_key, digest_of, split_uri, unpack, verify


def _project(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "train.py").write_text("print('hi')\n")
    (root / "pkg" / "model.py").write_text("X = 1\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    return root


def test_the_same_tree_packs_to_the_same_bytes_whatever_the_timestamps(tmp_path: Path) -> None:
    first = pack(_project(tmp_path / "a"))
    os.utime(tmp_path / "a" / "train.py", (1, 1))
    assert pack(tmp_path / "a").digest == first.digest
    # The same files in another folder: the same version.
    assert pack(_project(tmp_path / "b")).digest == first.digest
    (tmp_path / "b" / "train.py").write_text("print('changed')\n")
    assert pack(tmp_path / "b").digest != first.digest
    assert first.files == ("pkg/model.py", "run.sh", "train.py")


def test_the_exec_bit_survives_and_the_tree_comes_back_whole(tmp_path: Path) -> None:
    packed = pack(_project(tmp_path / "src"))
    assert unpack(packed.data, tmp_path / "out") == 3
    assert (tmp_path / "out" / "pkg" / "model.py").read_text() == "X = 1\n"
    assert os.access(tmp_path / "out" / "run.sh", os.X_OK)
    assert not os.access(tmp_path / "out" / "train.py", os.X_OK)


def test_gitignore_is_honoured_and_fleetdignore_wins_over_it(tmp_path: Path) -> None:
    src = _project(tmp_path / "src")
    (src / "data").mkdir()
    (src / "data" / "big.bin").write_bytes(b"x" * 100)
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref\n")
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"\0")
    (src / ".gitignore").write_text("data/\n")
    packed = pack(src)
    assert packed.ignore_file == ".gitignore"
    assert not any(f.startswith(("data/", ".git/", "__pycache__/")) for f in packed.files)
    (src / ".fleetdignore").write_text("*.sh\n")
    packed = pack(src)
    assert packed.ignore_file == ".fleetdignore"
    assert "run.sh" not in packed.files and "data/big.bin" in packed.files


def test_links_are_skipped_and_named(tmp_path: Path) -> None:
    src = _project(tmp_path / "src")
    (src / "dataset").symlink_to("/usr/share")
    (src / "latest.py").symlink_to(src / "train.py")
    packed = pack(src)
    assert packed.skipped_links == ("dataset", "latest.py")
    assert "latest.py" not in packed.files


@pytest.mark.parametrize("clash", ["agent.py", "agent/__init__.py", "fleetd/x.py"])
def test_a_workdir_that_would_shadow_fleetds_packages_is_refused(tmp_path: Path, clash: str) -> None:
    src = _project(tmp_path / "src")
    (src / clash).parent.mkdir(parents=True, exist_ok=True)
    (src / clash).write_text("")
    with pytest.raises(PackError, match="rename it"):
        pack(src)


def test_an_empty_or_missing_workdir_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PackError, match="not a folder"):
        pack(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PackError, match="no files"):
        pack(tmp_path / "empty")


def test_an_archive_is_refused_unless_it_hashes_to_the_digest_named(tmp_path: Path) -> None:
    packed = pack(_project(tmp_path / "src"))
    verify(packed.data, packed.digest)
    with pytest.raises(ProtocolError, match="refused"):
        verify(packed.data + b"\0", packed.digest)
    with pytest.raises(ProtocolError, match="SHA-256"):
        verify(packed.data, "ABC")


def _tar(*members: tarfile.TarInfo) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for m in members:
            tar.addfile(m, io.BytesIO(b"x" * m.size) if m.isfile() else None)
    return raw.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, size: int = 1, link: str = "") -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.size, m.linkname = kind, size if kind == tarfile.REGTYPE else 0, link
    return m


@pytest.mark.parametrize(
    "member",
    [
        _member("../escape.py"),
        _member("/etc/passwd"),
        _member("link", tarfile.SYMTYPE, link="/etc/passwd"),
        _member("hard", tarfile.LNKTYPE, link="train.py"),
        _member("dev", tarfile.CHRTYPE),
    ],
    ids=["dotdot", "absolute", "symlink", "hardlink", "device"],
)
def test_an_archive_member_outside_its_folder_or_not_a_file_is_refused_before_anything_is_written(
    tmp_path: Path, member: tarfile.TarInfo
) -> None:
    data = _tar(_member("ok.py"), member)
    with pytest.raises(ProtocolError):
        unpack(data, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_keys_and_uris() -> None:
    digest = digest_of(b"x")
    key = code_key("checkpoints/", "job", digest)
    assert key == f"checkpoints/job/code/{digest}.tar.gz"
    assert code_key("", "job", digest) == f"job/code/{digest}.tar.gz"
    assert split_uri(f"s3://bucket/{key}") == ("bucket", key)
    for bad in ("http://b/k", "s3://bucket", "s3:///k"):
        with pytest.raises(ProtocolError):
            split_uri(bad)


def test_unpacking_needs_no_extraction_filter_from_this_python(tmp_path: Path, monkeypatch) -> None:
    # Debian 12's Python 3.11.2 has no extractall(filter=): every unpack raised TypeError on a
    # node built from it (the deploy-box flow found it). unpack writes the checked members itself.
    def no_filter(self, path=".", members=None, *, numeric_owner=False, **kw):  # 3.11.2's signature
        if kw:
            raise TypeError(f"TarFile.extractall() got an unexpected keyword argument {next(iter(kw))!r}")
        raise AssertionError("unpack must not hand the archive to extractall")

    monkeypatch.setattr(tarfile.TarFile, "extractall", no_filter)
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (src / "pkg" / "run.sh").chmod(0o755)
    (src / "train.py").write_text("print('train')\n")
    packed = pack(src)
    assert unpack(packed.data, tmp_path / "out") == 2
    assert (tmp_path / "out" / "train.py").read_text() == "print('train')\n"
    assert os.access(tmp_path / "out" / "pkg" / "run.sh", os.X_OK)
    assert not os.access(tmp_path / "out" / "train.py", os.X_OK)
