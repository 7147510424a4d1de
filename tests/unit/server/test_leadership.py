"""Leadership (llmgw.server.ha): one holder of the leader lock per state directory;
a standby gets it once the leader's descriptor is closed, and reads where the leader serves."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import pytest

from llmgw.server.ha.leadership import await_lock
from llmgw.server.ha.standby import LEADER_HTTP, LEADER_STREAM, read_leader
from llmgw.server.store import Store
from llmgw.server.store.lock import try_lock


def test_one_leader_per_state_directory_and_the_standby_follows(tmp_path: Path) -> None:
    async def main() -> None:
        leader = try_lock(tmp_path)
        assert leader is not None
        assert try_lock(tmp_path) is None  # a second control plane is a standby
        waiting = asyncio.create_task(await_lock(tmp_path, interval=0.01))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        os.close(leader)  # the leader's process ends
        fd = await asyncio.wait_for(waiting, timeout=5)
        assert try_lock(tmp_path) is None
        os.close(fd)

    asyncio.run(main())


def test_a_standby_reads_the_leaders_addresses(tmp_path: Path) -> None:
    db = tmp_path / "llmgw.db"
    assert read_leader(db) == ("", "")  # no store yet: nothing known
    with Store.open(db) as store:
        store.set_meta(LEADER_STREAM, "10.0.0.1:7443")
        store.set_meta(LEADER_HTTP, "https://10.0.0.1:8080")
    assert read_leader(db) == ("10.0.0.1:7443", "https://10.0.0.1:8080")


def test_the_lock_is_never_opened_through_a_link(tmp_path: Path) -> None:
    # Root opens it too (server migrate): a link the directory's owner planted there must
    # not make root create, open or chown another file.
    target = tmp_path / "elsewhere"
    target.write_text("not a lock\n")
    (tmp_path / "leader.lock").symlink_to(target)
    with pytest.raises(OSError) as info:
        try_lock(tmp_path)
    assert info.value.errno == errno.ELOOP
    assert target.read_text() == "not a lock\n"
