"""Why no node can take a replica: the nodes grouped by what keeps them off (one group per
reason, each holding its nodes' ids as sorted runs), so that a refusal costs about what a
placement does; the reason per node is written out only when asked for."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice

__all__ = ["Headline", "Unplaceable", "node_list", "plural", "size_text"]

# Runs of node ids, each sorted, per reason: the groups of a refusal.
Groups = Mapping[str, Sequence[Sequence[str]]]

# Source problems that a headline stands for (any other keeps its node's own line).
PLAIN_SOURCE_PROBLEMS = ("no source ", "may not fetch ")


def size_text(mib: int) -> str:
    return f"{mib // 1024} GiB" if mib % 1024 == 0 else f"{mib} MiB"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def node_list(ids: Iterable[str], count: int, *, named: int = 3) -> str:
    """``count`` node ids as a person reads them: all of them when there are ``named`` or
    fewer, else the first two and how many others."""
    if count <= named:
        return ", ".join(ids)
    first = ", ".join(islice(ids, 2))
    return f"{first} and {count - 2} other nodes"


@dataclass(frozen=True)
class Headline:
    """No node that got as far as the source check passed it: one line says so, with the
    fix, and stands for those nodes' plain "no source" and "may not fetch" lines."""

    what: str
    fix: str
    checked: tuple[str, ...]  # in id order

    def text(self, *, every_node: bool) -> str:
        names = (
            ", ".join(self.checked)
            if every_node
            else node_list(iter(self.checked), len(self.checked))
        )
        return f"{self.what}; nodes checked: {names} ({self.fix})"


class Unplaceable:
    """Why no placement exists. :attr:`reasons` has one line per node that cannot take a
    shard, in id order, each starting with the node (after the source's headline, if any),
    and for a multi-node profile one per fabric; :attr:`lines` has one per group of nodes
    refused for the same reason (what :meth:`summary` shows of a large cluster).

    Built from the reasons themselves, or by the cluster from its groups; then the per-node
    lines are written on first use, from the groups as they were at the refusal."""

    __slots__ = ("_fabrics", "_groups", "_headline", "_lines", "_reasons")

    def __init__(self, reasons: Iterable[str]) -> None:
        self._reasons: tuple[str, ...] | None = tuple(reasons)
        self._groups: Groups | None = None  # None: built from the reasons
        self._headline: Headline | None = None
        self._fabrics: tuple[str, ...] = ()
        self._lines: tuple[str, ...] | None = None

    @classmethod
    def grouped(
        cls, groups: Groups, *, headline: Headline | None = None, fabrics: Sequence[str] = ()
    ) -> Unplaceable:
        """The refusal of ``groups`` (reason -> sorted runs of node ids; each node in one
        group only, no run empty), under ``headline``, before the ``fabrics`` lines."""
        self = cls(())
        self._reasons = None
        self._groups = groups
        self._headline = headline
        self._fabrics = tuple(fabrics)
        return self

    @property
    def reasons(self) -> tuple[str, ...]:
        if self._reasons is None:
            lines = [self._headline.text(every_node=True)] if self._headline else []
            if self._groups:
                lines.extend(f"{node_id}: {why}" for node_id, why in _per_node(self._groups))
            lines.extend(self._fabrics)
            self._reasons = tuple(lines)
        return self._reasons

    @property
    def lines(self) -> tuple[str, ...]:
        """One line per group: the headline, the fabrics, then the groups of nodes, the
        largest first, each naming its first nodes and how many others share the reason."""
        if self._lines is None:
            groups = self._groups
            if groups is None:
                self._lines = self.reasons
            else:
                sized = sorted(
                    (sum(len(run) for run in runs), _first(runs), why)
                    for why, runs in groups.items()
                )
                sized.sort(key=lambda g: -g[0])  # stable: the first node breaks ties
                head = [self._headline.text(every_node=False)] if self._headline else []
                self._lines = (
                    *head,
                    *self._fabrics,
                    *(
                        f"{node_list(_ids(groups[why]), count)}: {why}"
                        for count, _node, why in sized
                    ),
                )
        return self._lines

    def summary(self, limit: int = 5) -> str:
        """The first ``limit`` reasons on one line, and how many more there are: a line per
        node while there are no more than ``limit`` of them, else a line per group."""
        lines = self.reasons if self._count() <= limit else self.lines
        shown = "; ".join(lines[:limit])
        more = len(lines) - limit
        return f"{shown}; and {more} more" if more > 0 else shown

    def _count(self) -> int:
        """How long the per-node lines are, a headline counting a name per node checked."""
        if self._groups is None:
            return len(self.reasons)
        nodes = sum(len(run) for runs in self._groups.values() for run in runs)
        checked = len(self._headline.checked) if self._headline else 0
        return nodes + checked + len(self._fabrics)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Unplaceable):
            return NotImplemented
        return self.reasons == other.reasons

    def __hash__(self) -> int:
        return hash(self.reasons)

    def __repr__(self) -> str:
        return f"Unplaceable(reasons={self.reasons!r})"


def _per_node(groups: Groups) -> Iterator[tuple[str, str]]:
    """(node id, reason) of every node in the groups, in id order."""
    return heapq.merge(*(_tagged(why, runs) for why, runs in groups.items()))


def _tagged(why: str, runs: Sequence[Sequence[str]]) -> Iterator[tuple[str, str]]:
    for node_id in _ids(runs):
        yield node_id, why


def _ids(runs: Sequence[Sequence[str]]) -> Iterator[str]:
    return iter(runs[0]) if len(runs) == 1 else heapq.merge(*runs)


def _first(runs: Sequence[Sequence[str]]) -> str:
    return min(run[0] for run in runs)
