#!/usr/bin/env python3
"""Benchmark: what ``prefetch: true`` saves an engine's load of its weights.

Makes a weights folder (``--files`` files, ``--size`` in all, default 4 files of 1 GiB in
all) under ``--dir`` (default: the current folder, so that it is on a disk, not a tmpfs),
then:

1. evicts it from the page cache (``fdatasync`` and ``POSIX_FADV_DONTNEED`` per file) and
   checks that it went (the kernel's ``Cached`` falls by about its size);
2. times a cold full read in 1 MiB reads, which is what an engine's load pays;
3. evicts it again and runs the agent's warmer on it (:class:`llmgw.agent.warming.Warmer`,
   through a SourceStore whose models_root is the folder's parent, at ``--rate``: the
   agent's default prefetch_rate unless given);
4. times the same full read again.

It prints both reads, the warmer's pass and the speedup. A disk that is itself backed by the
host's page cache (a VM's virtual disk) reads fast even cold: the figures say what they
measure, no more. It is not a pass/fail test.

    .venv/bin/python bench/prefetch.py [--size 1GiB] [--files 4] [--rate 256MiB] [--dir .]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

from llmgw.agent.config import DEFAULT_PREFETCH_RATE
from llmgw.agent.inventory import meminfo
from llmgw.agent.models_dir import SourceStore
from llmgw.agent.warming import Warmer
from llmgw.configfile import parse_size

MIB = 1024**2


def make_weights(folder: Path, files: int, size: int) -> list[Path]:
    folder.mkdir()
    block = os.urandom(8 * MIB)
    each = size // files
    paths = []
    for i in range(files):
        path = folder / f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        with path.open("wb") as out:
            left = each
            while left > 0:
                n = min(left, len(block))
                out.write(block[:n])
                left -= n
            out.flush()
            os.fsync(out.fileno())
        paths.append(path)
    return paths


def evict(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_bytes() -> int:
    return meminfo().get("Cached", 0)


def full_read(paths: list[Path]) -> tuple[float, int]:
    """Seconds to read every file whole in 1 MiB reads, and the bytes read."""
    buf = bytearray(MIB)
    total = 0
    started = time.monotonic()
    for path in paths:
        with path.open("rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return time.monotonic() - started, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GiB", help="the weights' size in all (default 1GiB)")
    parser.add_argument("--files", type=int, default=4, help="how many files (default 4)")
    parser.add_argument("--rate", default=None, help="the warmer's cap (default: the agent's)")
    parser.add_argument("--dir", default=".", help="where the folder is made (default: here)")
    args = parser.parse_args()
    size = parse_size(args.size)
    rate = DEFAULT_PREFETCH_RATE if args.rate is None else parse_size(args.rate)
    root = Path(tempfile.mkdtemp(prefix="prefetch-bench-", dir=args.dir))
    try:
        paths = make_weights(root / "weights", args.files, size)
        print(f"weights: {args.files} files, {size / MIB:.0f} MiB in all, under {root}")

        before = cached_bytes()
        evict(paths)
        dropped = before - cached_bytes()
        print(
            f"evicted: page cache fell by {dropped / MIB:.0f} MiB "
            f"({100 * dropped / size:.0f}% of the weights)"
        )
        cold, total = full_read(paths)
        print(f"cold read:  {cold:7.3f} s  {total / MIB / cold:8.0f} MiB/s  (an engine's load)")

        evict(paths)
        warmer = Warmer(SourceStore(root, root / "cache"), rate=rate)
        warmer.want([("weights", "")])
        started = time.monotonic()
        state = asyncio.run(warmer.warm("weights"))
        took = time.monotonic() - started
        (status,) = warmer.status()
        print(
            f"warmer:     {took:7.3f} s  {status.bytes / MIB / took:8.0f} MiB/s  "
            f"(state {state}, cap {rate / MIB:.0f} MiB/s)"
        )
        warm, _ = full_read(paths)
        print(f"warm read:  {warm:7.3f} s  {total / MIB / warm:8.0f} MiB/s")
        print(f"speedup:    {cold / warm:7.1f}x  (cold read / warm read)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
