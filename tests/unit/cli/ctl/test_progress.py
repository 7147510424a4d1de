"""``ctl onboard``'s display: plain lines for a pipe, lines redrawn in place on a terminal,
the summary table, and nothing a host printed that could drive the operator's terminal."""

from __future__ import annotations

import io

from llmgw.cli.ctl.progress import Display, HostResult, summary


def test_plain_lines_one_per_step() -> None:
    out = io.StringIO()
    display = Display(out, ["gpu-01", "n2"], live=False)
    display.step("gpu-01", "connect", "root@10.0.0.11")
    display.step("n2", "failed", "ssh could not reach n2\x1b[2J")
    assert out.getvalue() == (
        "gpu-01  connect: root@10.0.0.11\nn2      failed: ssh could not reach n2?[2J\n"
    )


def test_live_lines_are_redrawn_in_place() -> None:
    out = io.StringIO()
    display = Display(out, ["a", "b"], live=True, columns=40)
    display.step("a", "install", "x" * 80)
    first = out.getvalue()
    assert first.count("\x1b[2K") == 2 and "\x1b[2F" not in first
    lines = first.split("\n")
    assert lines[0] == "\x1b[2Ka      0s  install: " + "x" * 19
    assert len(lines[0]) == len("\x1b[2K") + 39  # cut to the terminal's width
    assert lines[1].endswith("s  waiting")
    display.step("b", "online")
    again = out.getvalue()[len(first) :]
    assert again.startswith("\x1b[2F")  # back up over both lines, then both again
    assert again.count("\x1b[2K") == 2 and again.rstrip("\n").endswith("s  online")


def test_the_summary_table() -> None:
    results = [
        HostResult("gpu-01", "root@h1", "online", 41.4),
        HostResult("gpu-02", "root@h2", "failed", 3.0, "ssh could not reach root@h2\x07"),
        HostResult("gpu-03", "root@h3", "skipped", 0.2),
    ]
    assert summary(results) == (
        "NODE    RESULT   TIME  ERROR\n"
        "gpu-01  online   41s   -\n"
        "gpu-02  failed   3s    ssh could not reach root@h2?\n"
        "gpu-03  skipped  0s    -"
    )
    assert results[1].as_json() == {
        "node": "gpu-02",
        "ssh": "root@h2",
        "result": "failed",
        "seconds": 3.0,
        "error": "ssh could not reach root@h2\x07",
        "fingerprint": None,
        "steps": [],
        "warnings": [],
    }
