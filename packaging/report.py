"""The figures `make dist` prints: each artifact's size, and how long `llmgw --version` takes
to start (median of 5 runs) for the one-file and the one-folder build, against the targets.

usage: report.py --onefile FILE --onedir DIR [--bundle FILE] [--strip FILE] [--runs 5]
                 [--no-timing]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["ONEDIR_START_TARGET", "ONEFILE_SIZE_TARGET", "ONEFILE_START_TARGET", "start_times"]

# Bytes. 40 MB until cache-aware routing: the control plane's tokenizer (the tokenizers
# library, 11 MB of Rust unpacked, about 7 MB in the archive) and ZeroMQ came in with it, and
# the one binary carries every command.
ONEFILE_SIZE_TARGET = 48 * 1000 * 1000
ONEFILE_START_TARGET = 1.0  # seconds
ONEDIR_START_TARGET = 0.4


def start_times(binary: Path, runs: int = 5) -> list[float]:
    """Wall-clock seconds of ``runs`` runs of ``binary --version``, each checked to work."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([str(binary), "--version"], check=True, capture_output=True)
        times.append(time.perf_counter() - started)
    return times


def _size(path: Path) -> tuple[int, int]:
    if path.is_file():
        return path.stat().st_size, 1
    files = [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
    return sum(p.stat().st_size for p in files), len(files)


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def _verdict(value: float, target: float) -> str:
    return "ok" if value <= target else "ABOVE TARGET"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="report.py")
    parser.add_argument("--onefile", type=Path, required=True)
    parser.add_argument("--onedir", type=Path, required=True)
    parser.add_argument("--bundle", type=Path)
    parser.add_argument(
        "--strip", type=Path, help="what the build's strip step recorded (files, before, after)"
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--no-timing", action="store_true", help="sizes only (binaries of another architecture)"
    )
    args = parser.parse_args(argv)

    rows: list[tuple[str, str, str]] = []
    size, _ = _size(args.onefile)
    target = f"target <= {_mb(ONEFILE_SIZE_TARGET)}: {_verdict(size, ONEFILE_SIZE_TARGET)}"
    rows.append((args.onefile.name, _mb(size), target))
    size, count = _size(args.onedir)
    rows.append((args.onedir.name + "/", _mb(size), f"{count} files"))
    if args.strip is not None and args.strip.is_file():
        figures = dict(line.split() for line in args.strip.read_text().splitlines() if line)
        before, after = int(figures["before"]), int(figures["after"])
        rows.append(
            (
                "  its shared objects, stripped",
                f"{_mb(after)}",
                f"from {_mb(before)} ({figures['files']} files, "
                f"-{(before - after) / max(before, 1):.0%})",
            )
        )
    if args.bundle is not None and args.bundle.is_file():
        rows.append((args.bundle.name, _mb(_size(args.bundle)[0]), ""))
    timed = (
        ()
        if args.no_timing
        else (
            ("start-up, one-file", args.onefile, ONEFILE_START_TARGET),
            ("start-up, one-folder", args.onedir / "llmgw", ONEDIR_START_TARGET),
        )
    )
    if args.no_timing:
        rows.append(("start-up (llmgw --version)", "-", "not measured: another architecture"))
    for label, binary, goal in timed:
        times = start_times(binary, args.runs)
        median = statistics.median(times)
        rows.append(
            (
                f"{label} (llmgw --version)",
                f"{median:.2f} s",
                f"median of {len(times)}; target <= {goal:g} s: {_verdict(median, goal)}",
            )
        )
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"  {name:<{width}}  {value:>9}  {note}".rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
