"""What a frozen llmgw asks of the machine it runs on: the highest ``GLIBC_`` symbol version
each ELF file needs, for the binary itself and every library inside a PyInstaller one-file
archive, read without running anything (the arm64 binary is inspected on x86-64 too).

usage: python packaging/elfinfo.py FILE|DIR...   prints "VERSION  PATH" for every ELF, then
                                                  the floor: the highest of them
"""

from __future__ import annotations

import struct
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ElfNeeds",
    "carchive_members",
    "elf_needs",
    "glibc_floor",
    "needs_of_path",
    "version_key",
]

ELF_MAGIC = b"\x7fELF"
_COOKIE_MAGIC = b"MEI\014\013\012\013\016"
_COOKIE = struct.Struct("!8sIIII64s")
_TOC_ENTRY = struct.Struct("!IIIIBc")
_SHT_GNU_VERNEED = 0x6FFFFFFE


class ElfError(Exception):
    """A file that claims to be ELF (or a PyInstaller archive) but cannot be read as one."""


@dataclass(frozen=True)
class ElfNeeds:
    """One ELF file: where it was found, and the glibc symbol versions it needs."""

    name: str
    glibc: tuple[str, ...]  # e.g. ("2.2.5", "2.14"), sorted by version

    @property
    def highest(self) -> str | None:
        return self.glibc[-1] if self.glibc else None


def version_key(version: str) -> tuple[int, ...]:
    """'2.31' -> (2, 31): versions compare as numbers, so 2.4 < 2.17 < 2.31."""
    return tuple(int(part) for part in version.split("."))


def elf_needs(data: bytes, name: str = "<elf>") -> ElfNeeds:
    """The ``GLIBC_x.y`` versions that ELF image ``data`` needs (its SHT_GNU_verneed section),
    for 32- and 64-bit, little- and big-endian files; a static file needs none."""
    if data[:4] != ELF_MAGIC or len(data) < 64:
        raise ElfError(f"{name} is not an ELF file")
    is_64 = data[4] == 2
    endian = "<" if data[5] == 1 else ">"
    try:
        if is_64:
            shoff, shentsize, shnum = (
                struct.unpack_from(endian + "Q", data, 0x28)[0],
                *struct.unpack_from(endian + "HH", data, 0x3A),
            )
            section = struct.Struct(endian + "IIQQQQIIQQ")
        else:
            shoff, shentsize, shnum = (
                struct.unpack_from(endian + "I", data, 0x20)[0],
                *struct.unpack_from(endian + "HH", data, 0x2E),
            )
            section = struct.Struct(endian + "IIIIIIIIII")
        sections = [section.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
        versions: set[str] = set()
        for _name, kind, _flags, _addr, offset, _size, link, info, _align, _entsize in sections:
            if kind != _SHT_GNU_VERNEED:
                continue
            strtab_offset = sections[link][4]
            versions.update(_verneed_names(data, endian, offset, info, strtab_offset))
    except (struct.error, IndexError) as exc:
        raise ElfError(f"{name}: truncated or malformed ELF ({exc})") from exc
    glibc = sorted(
        (v.removeprefix("GLIBC_") for v in versions if v.startswith("GLIBC_2")),
        key=version_key,
    )
    return ElfNeeds(name=name, glibc=tuple(glibc))


def _verneed_names(data: bytes, endian: str, offset: int, count: int, strtab: int) -> Iterator[str]:
    need = struct.Struct(endian + "HHIII")  # vn_version, vn_cnt, vn_file, vn_aux, vn_next
    aux = struct.Struct(endian + "IHHII")  # vna_hash, vna_flags, vna_other, vna_name, vna_next
    for _ in range(count):
        _version, aux_count, _file, aux_offset, next_offset = need.unpack_from(data, offset)
        cursor = offset + aux_offset
        for _ in range(aux_count):
            _hash, _flags, _other, name_offset, aux_next = aux.unpack_from(data, cursor)
            start = strtab + name_offset
            yield data[start : data.index(b"\0", start)].decode("ascii", "replace")
            if not aux_next:
                break
            cursor += aux_next
        if not next_offset:
            break
        offset += next_offset


def carchive_members(path: Path) -> Iterator[tuple[str, bytes]]:
    """Every member of the PyInstaller archive appended to one-file binary ``path`` (the
    libraries it unpacks at every start), decompressed; nothing when it has none."""
    blob = path.read_bytes()
    cookie_at = blob.rfind(_COOKIE_MAGIC)
    if cookie_at < 0:
        return
    try:
        _magic, length, toc_offset, toc_length, _pyvers, _pylib = _COOKIE.unpack_from(
            blob, cookie_at
        )
        start = cookie_at + _COOKIE.size - length
        toc = blob[start + toc_offset : start + toc_offset + toc_length]
        cursor = 0
        while cursor < len(toc):
            entry_length, offset, size, _full, compressed, typecode = _TOC_ENTRY.unpack_from(
                toc, cursor
            )
            raw_name = toc[cursor + _TOC_ENTRY.size : cursor + entry_length]
            cursor += entry_length
            if typecode == b"o":  # a bootloader option, no data
                continue
            member = blob[start + offset : start + offset + size]
            yield raw_name.rstrip(b"\0").decode(), zlib.decompress(member) if compressed else member
    except (struct.error, zlib.error) as exc:
        raise ElfError(f"{path}: malformed PyInstaller archive ({exc})") from exc


def needs_of_path(path: Path) -> list[ElfNeeds]:
    """Every ELF in ``path`` (a file, or a directory walked without following links): each
    file itself and, for a one-file binary, every ELF member of its archive."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    found: list[ElfNeeds] = []
    for file in files:
        if file.is_symlink():
            continue
        with open(file, "rb") as handle:
            if handle.read(4) != ELF_MAGIC:
                continue
        found.append(elf_needs(file.read_bytes(), str(file)))
        for name, data in carchive_members(file):
            if data[:4] == ELF_MAGIC:
                found.append(elf_needs(data, f"{file}!{name}"))
    return found


def glibc_floor(needs: list[ElfNeeds]) -> str | None:
    """The oldest glibc all of ``needs`` run on: the highest version any of them needs."""
    highest = [n.highest for n in needs if n.highest]
    return max(highest, key=version_key) if highest else None


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python packaging/elfinfo.py FILE|DIR...", file=sys.stderr)
        return 2
    needs = [n for arg in argv for n in needs_of_path(Path(arg))]
    for item in needs:
        print(f"{item.highest or '-':8} {item.name}")
    print(f"glibc floor: {glibc_floor(needs) or 'none (static)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
