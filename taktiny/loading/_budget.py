"""A load's host memory kept within a budget (``max_host_bytes``): what counts (each step's
way of reading says what it holds while it is in flight), the refusal of a budget too
small for one step, and the order of starts that keeps the rest within it.

**What counts** is the host memory the load holds beyond the model's own arrays (those
are the load's result, whatever the budget): its scratch buffers, as mapped (kept from
their first read to the load's end), and what each step holds from the start of its read
until it is placed, as its way of reading says (`_ways`: a buffer on its way to other
devices, a piece of rows, a transform's results that are not the leaves, a stack's
layer placed on CPU devices until it is written into its stacked leaf).

Not counted: the model's arrays; the page cache, which the read-ahead fills (the kernel's,
reclaimed under pressure, not the process's; the read-ahead is nonetheless capped to
what the budget leaves, for storages that would fetch into the process); Python's and
XLA's own working memory inside one operation.
"""

from __future__ import annotations

from ._place import Scratch
from ._readers import Readers
from ._ways import Staged, Ways


class Budget:
    """The host memory a load may hold beyond the model's arrays (see the module's
    docstring for what counts), and the bookkeeping that keeps it there.

    Built from the headers before any read: the bytes each unit holds (``held``, its
    way's: while it is read and placed, or, for a transforming step, while the load's
    thread transforms it, one step at a time), the scratch buffers its ways take turns
    with, and ``error``, the refusal when one unit alone cannot fit (None when every one
    fits). While the load runs, :meth:`fits` says whether the next unit may start beside
    those in flight, and :meth:`take` and :meth:`release` count them.

    At any moment the load holds its scratch buffers, what the units in flight hold while
    they are read and placed, and the temporaries of one transform: the most of those of
    the transforming units in flight (:meth:`count`).

    Args:
        limit: the budget, in bytes; None: none (the load's schedule is unchanged).
        ways: how the load reads each unit (built within `limit`).
    """

    def __init__(self, limit: int | None, ways: Ways) -> None:
        self.limit, self.ways, self.layers = limit, ways, ways.load.layers
        self.held = ways.held
        self.making = [way.transforms for way in ways.units]
        self.scratch = sum(buffer.capacity for buffer in ways.buffers)
        self.flying: list[int] = []  # the units taken and not yet released
        self.peak = self.scratch  # the most counted at once
        self.error = None if limit is None else _refusal(self, limit)

    def count(self, units: list[int]) -> int:
        """The host bytes counted while `units` are in flight: the scratch buffers, what
        each holds while it is read and placed, and the most one transform makes."""
        reading = sum(self.held[u] for u in units if not self.making[u])
        making = max((self.held[u] for u in units if self.making[u]), default=0)
        return self.scratch + reading + making

    def room(self) -> int | None:
        """The bytes the budget leaves beside the scratch and the units in flight; None
        without a budget."""
        if self.limit is None:
            return None
        return max(0, self.limit - self.count(self.flying))

    def fits(self, unit: int) -> bool:
        """Whether `unit` may start beside the units in flight."""
        return self.limit is None or self.count([*self.flying, unit]) <= self.limit

    def take(self, unit: int) -> None:
        """Counts `unit` as in flight (its read starts)."""
        self.flying.append(unit)
        self.peak = max(self.peak, self.count(self.flying))

    def release(self, unit: int) -> None:
        """Counts `unit` as placed: what it held is free."""
        self.flying.remove(unit)

    def planned_peak(self, width: int | None = None) -> int:
        """The most the load counts at once, worked out from the headers by the load's own
        order of starts (:func:`~taktiny.io.load_safetensors`: in file order, while the
        readers, a free scratch buffer and the budget allow) with `width` readers (None:
        the most a load uses, `Readers`' ``most``; into stacks whose slices wait on their
        devices, the few units such a load keeps in flight). The load starts with two and
        doubles them while that pays, up to that most: a narrower load starts no unit
        earlier, so this bounds its peak, and never exceeds the budget. (A budget that is
        refused: the peak without it.)"""
        width = Readers().most if width is None else width
        if self.layers is not None:
            width = self.layers.widest(width)
        sim = Budget.__new__(Budget)
        sim.__dict__.update(self.__dict__)
        sim.flying, sim.peak = [], self.scratch
        if self.error is not None:
            sim.limit = None
        units = self.ways.units
        holder: set[Scratch] = set()  # the buffers holding a step's sources
        state = {"submitted": 0, "running": 0}

        def start() -> None:  # as the load's start_more
            while state["submitted"] < len(units) and state["running"] < width:
                u = state["submitted"]
                buffer = units[u].scratch
                if buffer is not None and buffer in holder:
                    return
                if sim.limit is not None:
                    if not sim.fits(u):
                        return
                if buffer is not None:
                    holder.add(buffer)
                sim.take(u)
                state["running"] += 1
                state["submitted"] += 1

        start()
        for u, way in enumerate(units):
            state["running"] -= 1  # (its result taken)
            start()
            buffer = way.scratch
            holder.discard(buffer)
            sim.release(u)
            if buffer is not None or sim.limit is not None:
                start()
        return sim.peak


def _refusal(budget: Budget, limit: int) -> ValueError | None:
    """The error for a budget that one unit cannot fit in beside the scratch buffer the
    load keeps; None when every one fits."""
    units, held = budget.ways.units, budget.held
    if not units or budget.scratch + max(held) <= limit:  # (each unit alone)
        return None
    own = [way.own() for way in units]
    u = max(range(len(units)), key=lambda j: (held[j], own[j]))
    needed = budget.scratch + held[u]
    sources = [n for part in units[u].parts for n in part.step.sources]
    targets = [n for part in units[u].parts for n in part.step.targets]
    named, into = _names(sources), _names(targets)
    parts = []
    if own[u] and isinstance(units[u], Staged):
        parts.append(f"a staging buffer of {own[u]:,} bytes to copy it onto its devices")
    elif own[u]:
        parts.append(f"a scratch buffer of {own[u]:,} bytes for its sources")
    elif budget.scratch:
        read = [way for way in units if way.scratch is not None]
        biggest = max(read, key=lambda way: Scratch.bytes_for(way.sources))
        parts.append(
            f"beside the scratch buffer of {budget.scratch:,} bytes the load keeps for "
            f"{', '.join(map(repr, biggest.step.sources))}"
        )
    if held[u] and budget.making[u]:
        parts.append(f"{held[u]:,} bytes of arrays its transform makes that are not leaves")
    elif held[u]:
        parts.append(f"{held[u]:,} bytes in flight, not its leaf's, while it is read and placed")
    where = budget.ways.load.where
    return ValueError(
        f"{where}: max_host_bytes={limit:,} ({_mib(limit)}) is too small for {named} "
        f"(into {into}): loading it needs {needed:,} bytes ({_mib(needed)}) of host memory "
        f"beyond the model's arrays ({'; '.join(parts)}). Nothing was read. Raise "
        f"max_host_bytes to at least {needed:,} ({_mib(needed)}), or pass None for no budget."
    )


def _names(names: list[str]) -> str:
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(map(repr, names[:3])) + more


def _mib(n: int) -> str:
    """`n` bytes in the unit that reads best: ``16.0 MiB``, ``192.0 KiB``, ``1 byte``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} byte" + ("" if n == 1 else "s")
