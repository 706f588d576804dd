"""Errors stay fast: the `tt.StateDictError` of a load full of misspelt names.

A load of the "many small blocks" model (see ``_models``) at 10,002 leaves, given 1,000
names each with one typo (two letters of its last part swapped, ``blocks.17.a.krenel``),
raises one error that lists them all and suggests the closest valid name for the first
100. The time is the whole failed load: resolving the names, finding the suggestions and
building the message. The target is 0.5 s. Each suggestion is checked to be the name
that was misspelt.
"""

from __future__ import annotations

import time

import numpy as np

import taktiny as tt

from . import _models
from ._results import Config, Group, Table, Target
from ._timing import compare

TARGET_S = 0.5
SYSTEM = "Taktiny"
OP = "load of 1,000 misspelt names (the error built)"


def _misspelt(names: list[str], count: int) -> dict[str, str]:
    """`count` of `names`, spread evenly, each with two letters of its last part swapped:
    misspelt name -> the name it came from."""
    out = {}
    for name in names[:: max(1, len(names) // count)][:count]:
        head, _, last = name.rpartition(".")
        out[f"{head}.{last[0]}{last[2]}{last[1]}{last[3:]}"] = name
    return out


def _load(model: tt.nn.Module, state: dict[str, np.ndarray]) -> tt.StateDictError:
    try:
        model.load_flat_state_dict(state)
    except tt.StateDictError as error:
        return error
    raise AssertionError("the load of misspelt names should have failed")


def run(config: Config) -> Group:
    """Times the failed load and checks its suggestions and the 0.5 s target."""
    start = time.perf_counter()
    group = Group("errors", "Errors stay fast")
    blocks, count = config.pick((1667, 1000), (1667, 1000), (20, 30))
    model = _models.build("taktiny", blocks, 0)
    names = list(model.flat_state_dict())
    typos = _misspelt(names, count)
    value = np.zeros(_models.WIDTH, np.float32)
    state = {typo: value for typo in typos}

    error = _load(model, state)
    assert len(error.problems) == len(typos)
    suggested = [p for p in error.problems if p.expected is not None]
    assert len(suggested) == min(100, len(typos)), len(suggested)
    wrong = [(p.name, p.expected) for p in suggested if p.expected != typos[p.name]]
    assert not wrong, f"wrong suggestions: {wrong[:5]}"

    stats = compare({SYSTEM: lambda: _load(model, state)}, repeat=config.pick(7, 3, 1))
    st = stats[SYSTEM]
    leaves = len(names)
    table = Table(
        f"StateDictError of {len(typos):,} misspelt names, {leaves:,}-leaf model", [SYSTEM]
    )
    table.add(OP, SYSTEM, "model.load_flat_state_dict(misspelt)", st.median, (st.low, st.high))
    group.tables.append(table)
    group.targets.append(
        Target(
            f"the error of {len(typos):,} misspelt names in a {leaves:,}-leaf model built in "
            f"<= {TARGET_S} s",
            st.median / TARGET_S,
            1.0,
            False,
            f"time of the failed load / {TARGET_S} s",
        )
    )
    group.notes.append(
        f"{len(typos):,} names, each a leaf's name with two letters of its last part swapped "
        f"(`blocks.17.a.krenel`); the error lists all of them and suggests a name for the "
        f"first 100, each checked to be the name misspelt. Median {st.median * 1e3:.1f} ms "
        f"= {st.median / TARGET_S:.3f}x the {TARGET_S} s target."
    )
    group.seconds = time.perf_counter() - start
    return group
