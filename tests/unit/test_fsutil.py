"""Unit tests of llmgw.fsutil: atomic writes and the one safe unpack of tar and zip archives."""

from __future__ import annotations

import io
import os
import resource
import signal
import stat
import tarfile
import zipfile
from pathlib import Path

import pytest

from llmgw import fsutil
from llmgw.errors import ArchiveError, FileError
from llmgw.fsutil import ArchivePolicy

# Umask 000, so the modes checked are the ones the code sets itself.
pytestmark = pytest.mark.usefixtures("open_umask")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# -- atomic writes ---------------------------------------------------------------------------


def test_write_private_is_0600_before_it_appears(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []
    real_replace = os.replace

    def spy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        seen.append(mode(Path(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    target = tmp_path / "secret.key"
    target.write_bytes(b"old")
    os.chmod(target, 0o644)
    fsutil.write_private(target, b"new")
    assert seen == [0o600]
    assert target.read_bytes() == b"new"
    assert mode(target) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["secret.key"]


def test_write_failure_names_the_file_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "missing-dir" / "x.key"
    with pytest.raises(FileError, match=r"cannot write .*x\.key.*exists and is writable") as info:
        fsutil.write_private(target, b"data")
    assert info.value.path == str(target)
    assert list(tmp_path.iterdir()) == []


def test_failed_rename_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "dir-in-the-way"
    target.mkdir()
    (target / "inside").write_text("x")
    with pytest.raises(FileError, match="cannot write"):
        fsutil.atomic_write(target, b"data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir-in-the-way"]


def test_atomic_write_sets_the_mode_exactly_and_replaces(tmp_path: Path) -> None:
    target = tmp_path / "public.crt"
    fsutil.atomic_write(target, b"one", mode=0o640)
    assert (target.read_bytes(), mode(target)) == (b"one", 0o640)
    fsutil.atomic_write(target, b"two", fsync=False)
    assert (target.read_bytes(), mode(target)) == (b"two", 0o644)


def test_atomic_write_never_writes_through_a_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    link = tmp_path / "status.json"
    link.symlink_to(victim)
    fsutil.atomic_write(link, b"new")
    assert victim.read_text() == "keep"
    assert not link.is_symlink() and link.read_bytes() == b"new"


def test_atomic_write_in_a_directory_descriptor(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fsutil.atomic_write("counter", b"7\n", mode=0o600, dir_fd=fd)
        fsutil.atomic_write("counter", b"8\n", mode=0o600, dir_fd=fd)
    finally:
        os.close(fd)
    assert (tmp_path / "counter").read_bytes() == b"8\n"
    assert mode(tmp_path / "counter") == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["counter"]


def test_atomic_write_with_an_owner(tmp_path: Path) -> None:
    fsutil.atomic_write(tmp_path / "f", b"x", owner=(os.getuid(), os.getgid()))
    st = os.stat(tmp_path / "f")
    assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())


def test_stage_file_then_commit(tmp_path: Path) -> None:
    target = tmp_path / "node.key"
    tmp = fsutil.stage_file(target, b"key", mode=0o600)
    assert Path(tmp).parent == tmp_path and Path(tmp).name.startswith(".node.key.")
    assert mode(Path(tmp)) == 0o600 and not target.exists()
    os.replace(tmp, target)
    assert target.read_bytes() == b"key"


def test_create_file_never_replaces(tmp_path: Path) -> None:
    target = tmp_path / "agent.yaml"
    assert fsutil.create_file(target, b"first", mode=0o640) is True
    assert mode(target) == 0o640
    assert fsutil.create_file(target, b"second") is False
    assert target.read_bytes() == b"first"
    assert [p.name for p in tmp_path.iterdir()] == ["agent.yaml"]


def test_make_dir_sets_the_mode_and_tightens_on_request(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    fsutil.make_dir(target, mode=0o750)
    assert mode(target) == 0o750
    target.chmod(0o777)
    fsutil.make_dir(target)  # exists: left alone
    assert mode(target) == 0o777
    fsutil.make_dir(target, tighten=True)
    assert mode(target) == 0o700
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileError, match=r"cannot create directory .*file/sub.*mode 0700"):
        fsutil.make_dir(tmp_path / "file" / "sub")


def test_fsync_dir_never_raises(tmp_path: Path) -> None:
    fsutil.fsync_dir(tmp_path)
    fsutil.fsync_dir(tmp_path / "missing")
    fsutil.fsync_dir(str(tmp_path))
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    os.close(fd)
    fsutil.fsync_dir(fd)  # closed: EBADF swallowed


# -- archives --------------------------------------------------------------------------------

LOOSE = ArchivePolicy(max_bytes=1 << 20, place="install folder")
STRICT = ArchivePolicy(max_bytes=1 << 20, max_members=20, links=False, single_top=True)


def entry(
    name: str,
    data: bytes = b"",
    *,
    kind: bytes = tarfile.REGTYPE,
    link: str = "",
    perm: int = 0o644,
    mtime: int = 1_600_000_000,
) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.mode = perm
    info.mtime = mtime
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    return info, data


def tarball(path: Path, entries: list[tuple[tarfile.TarInfo, bytes]], fmt: str = "w:gz") -> Path:
    with tarfile.open(path, fmt) as tf:  # type: ignore[call-overload]
        for info, data in entries:
            tf.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


def zipped(path: Path, entries: list[tuple[str, int, bytes]]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, attr, data in entries:
            info = zipfile.ZipInfo(name, date_time=(2020, 9, 13, 12, 26, 40))
            info.external_attr = attr << 16
            zf.writestr(info, data)
    return path


def unpack(tmp_path: Path, archive: Path, policy: ArchivePolicy = LOOSE, kind: str = "tar") -> Path:
    dest = tmp_path / "dest"
    dest.mkdir()
    fsutil.unpack_archive(archive, dest, kind=kind, policy=policy)  # type: ignore[arg-type]
    return dest


def refused(
    tmp_path: Path, archive: Path, policy: ArchivePolicy = LOOSE, kind: str = "tar"
) -> ArchiveError:
    dest = tmp_path / "dest"
    dest.mkdir(exist_ok=True)
    with pytest.raises(ArchiveError) as info:
        fsutil.unpack_archive(archive, dest, kind=kind, policy=policy)  # type: ignore[arg-type]
    return info.value


def test_tar_unpacks_files_dirs_and_links_with_safe_modes(tmp_path: Path) -> None:
    archive = tarball(
        tmp_path / "a.tar.gz",
        [
            entry("pkg", kind=tarfile.DIRTYPE, perm=0o555),
            entry("pkg/bin", kind=tarfile.DIRTYPE, perm=0o777),
            entry("pkg/bin/server", b"#!/bin/sh\n", perm=0o4777),
            entry("pkg/lib.so", b"lib", perm=0o640),
            entry("pkg/bin/lib.so", kind=tarfile.SYMTYPE, link="../lib.so"),
            entry("pkg/hard", kind=tarfile.LNKTYPE, link="pkg/lib.so"),
        ],
    )
    dest = unpack(tmp_path, archive)
    root = dest / "pkg"
    assert (root / "bin" / "server").read_bytes() == b"#!/bin/sh\n"
    assert mode(root / "bin" / "server") == 0o755  # no setuid, no group/world write
    assert mode(root / "lib.so") == 0o640
    assert mode(root) == 0o755  # owner may always write its folders
    assert mode(root / "bin") == 0o755
    assert os.readlink(root / "bin" / "lib.so") == "../lib.so"
    assert os.stat(root / "hard").st_ino == os.stat(root / "lib.so").st_ino
    assert os.stat(root / "lib.so").st_mtime == 1_600_000_000


def test_a_tar_made_of_dot_unpacks_into_the_destination(tmp_path: Path) -> None:
    archive = tarball(
        tmp_path / "a.tar",
        [
            entry(".", kind=tarfile.DIRTYPE, perm=0o755),
            entry("./bin", kind=tarfile.DIRTYPE),
            entry("./bin/x", b"x", perm=0o755),
        ],
        fmt="w",
    )
    dest = unpack(tmp_path, archive)
    assert (dest / "bin" / "x").read_bytes() == b"x"


def test_list_archive_checks_without_writing(tmp_path: Path) -> None:
    archive = tarball(tmp_path / "a.tar", [entry("top/f", b"abc")], fmt="w")
    members = fsutil.list_archive(archive, kind="tar", policy=STRICT)
    assert [(m.name, m.kind, m.size) for m in members] == [("top/f", "file", 3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tar"]


@pytest.mark.parametrize(
    ("member", "reason"),
    [
        (entry("../evil", b"x"), "has a '..' component"),
        (entry("pkg/../../evil", b"x"), "has a '..' component"),
        (entry("/tmp/llmgw-abs-evil", b"x"), "has an absolute path"),
        (entry("C:/evil", b"x"), "has an absolute path"),
        (entry("pkg\\..\\evil", b"x"), "has a backslash"),
        (entry("pkg//evil", b"x"), "has an empty path component"),
        (
            entry("pkg/escape", kind=tarfile.SYMTYPE, link="../../outside"),
            "is a symlink to '../../outside', outside the install folder",
        ),
        (
            entry("pkg/passwd", kind=tarfile.SYMTYPE, link="/etc/passwd"),
            "is a symlink to '/etc/passwd', outside the install folder",
        ),
        (
            entry("pkg/hard", kind=tarfile.LNKTYPE, link="/etc/passwd"),
            "is a hard link to '/etc/passwd', outside the install folder",
        ),
        (
            entry("pkg/up", kind=tarfile.LNKTYPE, link="../outside"),
            "is a hard link to '../outside', outside the install folder",
        ),
        (
            entry("pkg/later", kind=tarfile.LNKTYPE, link="pkg/missing"),
            "is a hard link to 'pkg/missing', which is no file before it",
        ),
        (entry("pkg/pipe", kind=tarfile.FIFOTYPE), "is a fifo, not a file, directory or link"),
        (entry("pkg/null", kind=tarfile.CHRTYPE), "is a device file, not a file, directory"),
        (entry("pkg/disk", kind=tarfile.BLKTYPE), "is a device file"),
        (entry(".", b"x"), "would replace the install folder itself"),
    ],
)
def test_unsafe_tar_members_are_refused_before_anything_is_written(
    tmp_path: Path, member: tuple[tarfile.TarInfo, bytes], reason: str
) -> None:
    archive = tarball(
        tmp_path / "a.tar.gz", [entry("pkg", kind=tarfile.DIRTYPE), entry("pkg/ok", b"ok"), member]
    )
    error = refused(tmp_path, archive)
    assert error.code == "unsafe"
    assert error.member == member[0].name
    assert reason in error.reason
    assert str(error).startswith(f"member {member[0].name!r} ")
    assert list((tmp_path / "dest").iterdir()) == []
    assert not (tmp_path / "evil").exists()
    assert not os.path.lexists("/tmp/llmgw-abs-evil")


def test_the_name_is_judged_before_the_kind(tmp_path: Path) -> None:
    archive = tarball(tmp_path / "a.tar", [entry("/dev/evil", kind=tarfile.CHRTYPE)], fmt="w")
    assert refused(tmp_path, archive).reason == "has an absolute path"


def test_a_symlink_chain_escaping_through_an_earlier_link_is_refused(tmp_path: Path) -> None:
    # Each link looks inside on its own; followed on disk, "e" is the folder's parent.
    archive = tarball(
        tmp_path / "a.tar",
        [
            entry("d", kind=tarfile.DIRTYPE),
            entry("d/l", kind=tarfile.SYMTYPE, link=".."),
            entry("e", kind=tarfile.SYMTYPE, link="d/l/.."),
            entry("e/evil", b"x"),
        ],
        fmt="w",
    )
    error = refused(tmp_path, archive)
    assert "member 'e' is a symlink to 'd/l/..', outside the install folder" in str(error)
    assert not (tmp_path / "evil").exists()


def test_a_later_file_replaces_a_symlink_and_never_writes_through_it(tmp_path: Path) -> None:
    archive = tarball(
        tmp_path / "a.tar",
        [
            entry("target", b"original"),
            entry("name", kind=tarfile.SYMTYPE, link="target"),
            entry("name", b"replacement"),
        ],
        fmt="w",
    )
    dest = unpack(tmp_path, archive)
    assert (dest / "target").read_bytes() == b"original"
    assert not (dest / "name").is_symlink()
    assert (dest / "name").read_bytes() == b"replacement"


def test_a_folder_moved_outside_by_a_later_link_keeps_its_mode(tmp_path: Path) -> None:
    # Folder modes are set last; by then a later member has re-pointed "c", so the path
    # "p/secret" that was inside when unpacked now leads to tmp_path/secret, outside.
    secret = tmp_path / "secret"
    secret.mkdir(mode=0o700)
    archive = tarball(
        tmp_path / "a.tar",
        [
            entry("sub", kind=tarfile.DIRTYPE),
            entry("c", kind=tarfile.SYMTYPE, link="sub"),
            entry("p", kind=tarfile.SYMTYPE, link="c/.."),
            entry("p/secret", kind=tarfile.DIRTYPE, perm=0o755, mtime=1),
            entry("c", kind=tarfile.SYMTYPE, link="."),
        ],
        fmt="w",
    )
    error = refused(tmp_path, archive)
    assert error.code == "unsafe" and error.member == "p/secret"
    assert "outside the install folder through a symlink" in str(error)
    assert mode(secret) == 0o700
    assert secret.stat().st_mtime != 1


@pytest.mark.parametrize(
    ("member", "reason"),
    [
        (entry("top/escape", kind=tarfile.SYMTYPE, link="/etc"), "is a link (a symlink"),
        (entry("top/rel", kind=tarfile.SYMTYPE, link="inside"), "is a link (a symlink"),
        (entry("top/shadow", kind=tarfile.LNKTYPE, link="top/f"), "is a link (a hard link"),
        (entry("top/null", kind=tarfile.CHRTYPE), "is a device file, not a file or directory"),
        (entry("other/f", b"x"), "is outside the top folder top/"),
    ],
)
def test_strict_policy_allows_only_files_and_dirs_under_one_top(
    tmp_path: Path, member: tuple[tarfile.TarInfo, bytes], reason: str
) -> None:
    archive = tarball(
        tmp_path / "a.tar.gz", [entry("top", kind=tarfile.DIRTYPE), entry("top/f", b"x"), member]
    )
    error = refused(tmp_path, archive, STRICT, "tar.gz")
    assert reason in error.reason


def test_strict_policy_unpacks_a_plain_bundle(tmp_path: Path) -> None:
    archive = tarball(
        tmp_path / "a.tar.gz",
        [entry("top", kind=tarfile.DIRTYPE), entry("top/install.sh", b"#!/bin/sh\n", perm=0o755)],
    )
    dest = unpack(tmp_path, archive, STRICT, "tar.gz")
    assert mode(dest / "top" / "install.sh") == 0o755


def test_without_replace_a_name_held_twice_is_refused(tmp_path: Path) -> None:
    once = ArchivePolicy(max_bytes=1 << 20, links=False, replace=False)
    folders = [entry("top", kind=tarfile.DIRTYPE), entry("top/", kind=tarfile.DIRTYPE)]
    dest = unpack(
        tmp_path, tarball(tmp_path / "ok.tar", [*folders, entry("top/f", b"x")], "w"), once
    )
    assert (dest / "top" / "f").read_bytes() == b"x"  # a folder may be named again
    for i, twice in enumerate(
        [
            [entry("top/f", b"checked"), entry("top/f", b"unpacked")],
            [entry("top/f", b"checked"), entry("top/./f", b"unpacked")],
            [entry("top/f", kind=tarfile.DIRTYPE), entry("top/f", b"x")],
            [entry("top/f", b"x"), entry("top/f", kind=tarfile.DIRTYPE)],
        ]
    ):
        archive = tarball(tmp_path / f"{i}.tar", twice, fmt="w")
        with pytest.raises(ArchiveError, match="is in the archive twice") as error:
            fsutil.list_archive(archive, kind="tar", policy=once)
        assert error.value.code == "unsafe"
    # The default (engine installs): a later member takes the earlier one's place.
    archive = tarball(tmp_path / "r.tar", [entry("f", b"first"), entry("f", b"second")], "w")
    (tmp_path / "r").mkdir()
    assert (unpack(tmp_path / "r", archive) / "f").read_bytes() == b"second"


def test_too_many_members_and_too_many_bytes(tmp_path: Path) -> None:
    many = tarball(
        tmp_path / "many.tar.gz",
        [entry("top", kind=tarfile.DIRTYPE)] + [entry(f"top/{i}", b"") for i in range(25)],
    )
    error = refused(tmp_path, many, STRICT, "tar.gz")
    assert error.code == "too_many" and "more than 20 members" in str(error)
    big = tarball(tmp_path / "big.tar.gz", [entry("a", b"x" * 700_000), entry("b", b"x" * 700_000)])
    error = refused(tmp_path, big)
    assert error.code == "too_big" and f"more than {1 << 20} bytes" in str(error)
    assert list((tmp_path / "dest").iterdir()) == []


@pytest.mark.parametrize("kind", ["tar", "tar.gz", "zip"])
def test_garbage_is_unreadable(tmp_path: Path, kind: str) -> None:
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"not an archive at all" * 10)
    error = refused(tmp_path, garbage, LOOSE, kind)
    assert error.code == "unreadable"
    assert "cannot be read as an archive" in str(error)


def test_tar_gz_means_gzip_only(tmp_path: Path) -> None:
    archive = tarball(tmp_path / "a.tar.xz", [entry("f", b"x")], fmt="w:xz")
    assert refused(tmp_path, archive, LOOSE, "tar.gz").code == "unreadable"
    other = tmp_path / "other"
    other.mkdir()
    assert (unpack(other, archive) / "f").read_bytes() == b"x"


def test_a_damaged_tar_is_unreadable(tmp_path: Path) -> None:
    archive = tarball(tmp_path / "a.tar.gz", [entry("f", b"x" * 100_000)])
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) // 2])
    assert refused(tmp_path, archive).code == "unreadable"


def test_zip_unpacks_with_modes_links_and_times(tmp_path: Path) -> None:
    archive = zipped(
        tmp_path / "a.zip",
        [
            ("build/", stat.S_IFDIR | 0o755, b""),
            ("build/bin/llama-server", stat.S_IFREG | 0o6777, b"#!/bin/sh\n"),
            ("build/plain", 0, b"no mode"),
            ("build/link", stat.S_IFLNK | 0o777, b"plain"),
        ],
    )
    dest = unpack(tmp_path, archive, kind="zip")
    assert mode(dest / "build" / "bin" / "llama-server") == 0o755
    assert mode(dest / "build" / "plain") == 0o600  # what zipfile gives a member without one
    assert os.readlink(dest / "build" / "link") == "plain"
    assert (dest / "build" / "link").read_bytes() == b"no mode"


@pytest.mark.parametrize(
    ("entries", "reason"),
    [
        ([("../evil", 0, b"x")], "member '../evil' has a '..' component"),
        ([("/abs-evil", 0, b"x")], "member '/abs-evil' has an absolute path"),
        (
            [("build/up", stat.S_IFLNK | 0o777, b"../../x")],
            "member 'build/up' is a symlink to '../../x', outside the install folder",
        ),
        ([("build/fifo", stat.S_IFIFO | 0o644, b"")], "member 'build/fifo' is a fifo"),
        ([("build/dev", stat.S_IFCHR | 0o644, b"")], "is a device or special file"),
        ([("build/long", stat.S_IFLNK | 0o777, b"x" * 5000)], "oversized target"),
    ],
)
def test_unsafe_zip_members_are_refused(
    tmp_path: Path, entries: list[tuple[str, int, bytes]], reason: str
) -> None:
    archive = zipped(tmp_path / "a.zip", [("build/ok", 0, b"ok"), *entries])
    error = refused(tmp_path, archive, LOOSE, "zip")
    assert error.code == "unsafe"
    assert reason in str(error)
    assert list((tmp_path / "dest").iterdir()) == []


def test_a_write_the_system_refuses_is_write_failed(tmp_path: Path) -> None:
    """A member the file system will not take (here: past the process's file-size limit, which
    binds root too) fails as ``write_failed``, not as an unsafe archive."""
    archive = tarball(tmp_path / "a.tar", [entry("f", b"x" * 65536)], fmt="w")
    dest = tmp_path / "dest"
    dest.mkdir()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(ArchiveError) as info:
            fsutil.unpack_archive(archive, dest, kind="tar", policy=LOOSE)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert info.value.code == "write_failed"
