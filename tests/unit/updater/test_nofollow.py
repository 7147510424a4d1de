"""The root helper's plain-file reads (llmgw.updater.nofollow): a regular file of bounded size
is read; a symlink, a FIFO, a directory or a larger file is refused without being opened
through or read; a missing file is left to the caller."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmgw.updater.nofollow import OPEN_DIR, NotPlain, open_plain, read_plain


def test_a_regular_file_is_read_by_path_and_under_a_directory(tmp_path: Path) -> None:
    (tmp_path / "order.json").write_bytes(b"{}")
    assert read_plain(tmp_path / "order.json", limit=10) == b"{}"
    dir_fd = os.open(tmp_path, OPEN_DIR)
    try:
        assert read_plain("order.json", limit=2, dir_fd=dir_fd) == b"{}"
        fd = open_plain("order.json", dir_fd=dir_fd)
        os.close(fd)
    finally:
        os.close(dir_fd)


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("symlink", "a symlink"),
        ("fifo", "not a regular file"),
        ("directory", "not a regular file"),
        ("large", "11 bytes, more than 10"),
    ],
)
def test_what_is_not_a_small_plain_file_is_refused(tmp_path: Path, kind: str, reason: str) -> None:
    target = tmp_path / "secret"
    target.write_bytes(b"root:x:0:0\n")
    path = tmp_path / "file"
    if kind == "symlink":
        path.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(path)  # opening it must not block: O_NONBLOCK
    elif kind == "directory":
        path.mkdir()
    else:
        path = target
    with pytest.raises(NotPlain) as info:
        read_plain(path, limit=10)
    assert info.value.reason == reason


def test_a_missing_file_is_the_callers_to_judge(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_plain(tmp_path / "absent", limit=10)
