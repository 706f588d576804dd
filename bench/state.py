"""State read/write: Taktiny's state calls against NNX, Equinox and PyTorch.

On the 384-leaf and 3,000-leaf "many small blocks" models (see ``_models``):
reading the state, a full load of a *different* model's state of the same
architecture, a partial load of 10% of the blocks, a load of one block (its six
leaves, nested and flat), and swapping one block for another. Every system's calls are
timed in one interleaved run; ratios are (peer time) / (Taktiny time), and the one-block
load and the swap are also compared with Taktiny's own full load.
"""

from __future__ import annotations

import time
from typing import Any

import equinox as eqx
import jax
from flax import nnx

from . import _models
from ._results import Config, Group, Table, Target, faster
from ._timing import compare

SYSTEMS = ["Taktiny", "Flax NNX", "NNX split/merge", "Equinox", "PyTorch"]
READ, READ_FLAT, LOAD, PARTIAL = "read state", "read flat state", "full load", "10% partial load"
ONE, ONE_FLAT, SWAP = "one-block load", "one-block flat load", "swap one block"


def _cases(n: int) -> dict[str, dict[str, tuple[str, Any]]]:
    """op -> system -> (call shown in the report, zero-argument callable)."""
    k = max(1, round(n / 10))  # blocks in the partial load
    other = lambda x: x * 0.5 + 1.0  # another model of the same architecture, built fast
    tt = _models.build("taktiny", n, 0)
    state = jax.tree.map(other, tt).state_dict()
    partial = {"blocks": {str(i): state["blocks"][str(i)] for i in range(k)}}

    nx = _models.build("nnx", n, 0)
    nx_state = jax.tree.map(other, nnx.state(nx))
    nx_partial = nnx.State({"blocks": {i: nx_state["blocks"][i] for i in range(k)}})
    graphdef = nnx.graphdef(nx)

    eq = _models.build("equinox", n, 0)
    eq_leaves = jax.tree.leaves(jax.tree.map(other, eq))
    eq_part = eq_leaves[: k * _models.LEAVES_PER_BLOCK]

    th = _models.build("torch", n, 0)
    th_state = _models.build("torch", n, 1).state_dict()
    th_partial = {key: v for key, v in th_state.items() if int(key.split(".")[1]) < k}

    j = n // 2  # the block loaded or swapped alone
    one = {"blocks": {str(j): state["blocks"][str(j)]}}
    one_flat = {f"blocks.{j}.{name}": v for name, v in _flat(state["blocks"][str(j)])}
    swapped = [*tt.blocks[:j], jax.tree.map(other, tt.blocks[j]), *tt.blocks[j + 1 :]]
    nx_one = nnx.State({"blocks": {j: nx_state["blocks"][j]}})
    eq_block = jax.tree.map(other, eq.blocks[j])
    th_one = {key: v for key, v in th_state.items() if int(key.split(".")[1]) == j}

    return {
        READ: {
            "Taktiny": ("model.state_dict()", tt.state_dict),
            "Flax NNX": ("nnx.state(model)", lambda: nnx.state(nx)),
            "NNX split/merge": ("nnx.split(model)", lambda: nnx.split(nx)),
            "Equinox": ("jax.tree_util.tree_flatten_with_path(model)", lambda: _eqx_read(eq)),
            "PyTorch": ("model.state_dict()", th.state_dict),
        },
        READ_FLAT: {
            "Taktiny": ("model.flat_state_dict()", tt.flat_state_dict),
            "Flax NNX": ("nnx.to_flat_state(nnx.state(model))", lambda: _nnx_flat(nx)),
            "Equinox": ("jax.tree.leaves(model)", lambda: jax.tree.leaves(eq)),
            "PyTorch": ("model.state_dict() (already flat)", th.state_dict),
        },
        LOAD: {
            "Taktiny": ("model.load_state_dict(other)", lambda: tt.load_state_dict(state)),
            "Flax NNX": ("nnx.update(model, other)", lambda: nnx.update(nx, nx_state)),
            "NNX split/merge": (
                "nnx.merge(graphdef, other)",
                lambda: nnx.merge(graphdef, nx_state),
            ),
            "Equinox": (
                "jax.tree.unflatten(jax.tree.structure(model), other)",
                lambda: _eqx_load(eq, eq_leaves),
            ),
            "PyTorch": ("model.load_state_dict(other)", lambda: th.load_state_dict(th_state)),
        },
        PARTIAL: {
            "Taktiny": ("model.load_state_dict(part)", lambda: tt.load_state_dict(partial)),
            "Flax NNX": ("nnx.update(model, part)", lambda: nnx.update(nx, nx_partial)),
            "Equinox": ("eqx.tree_at(where, model, part)", lambda: _eqx_partial(eq, k, eq_part)),
            "PyTorch": (
                "model.load_state_dict(part, strict=False)",
                lambda: th.load_state_dict(th_partial, strict=False),
            ),
        },
        ONE: {
            "Taktiny": ("model.load_state_dict(one)", lambda: tt.load_state_dict(one)),
            "Flax NNX": ("nnx.update(model, one)", lambda: nnx.update(nx, nx_one)),
            "Equinox": (
                "eqx.tree_at(lambda m: m.blocks[j], model, block)",
                lambda: eqx.tree_at(lambda m: m.blocks[j], eq, eq_block),
            ),
            "PyTorch": (
                "model.load_state_dict(one, strict=False)",
                lambda: th.load_state_dict(th_one, strict=False),
            ),
        },
        ONE_FLAT: {
            "Taktiny": (
                "model.load_flat_state_dict(one)",
                lambda: tt.load_flat_state_dict(one_flat),
            ),
        },
        SWAP: {
            "Taktiny": ("model.replace(blocks=swapped)", lambda: tt.replace(blocks=swapped)),
            "Equinox": (
                "eqx.tree_at(lambda m: m.blocks[j], model, block)",
                lambda: eqx.tree_at(lambda m: m.blocks[j], eq, eq_block),
            ),
        },
    }


def _flat(nested: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in nested.items():
        out += (
            _flat(value, f"{prefix}{key}.") if isinstance(value, dict) else [(prefix + key, value)]
        )
    return out


def _eqx_read(model: Any) -> Any:
    return jax.tree_util.tree_flatten_with_path(model)


def _nnx_flat(model: Any) -> Any:
    return nnx.to_flat_state(nnx.state(model))


def _eqx_load(model: Any, leaves: list[Any]) -> Any:
    return jax.tree.unflatten(jax.tree.structure(model), leaves)


def _eqx_partial(model: Any, k: int, leaves: list[Any]) -> Any:
    return eqx.tree_at(lambda m: jax.tree.leaves(m.blocks[:k]), model, leaves)


def _check(cases: dict[str, dict[str, tuple[str, Any]]]) -> None:
    """The Taktiny loads really load: the other model's arrays where supplied, own elsewhere."""
    own = cases[READ]["Taktiny"][1]()["blocks"]
    new, part = cases[LOAD]["Taktiny"][1](), cases[PARTIAL]["Taktiny"][1]()
    assert new.blocks[0].a.kernel is not own["0"]["a"]["kernel"]
    assert part.blocks[0].a.kernel is new.blocks[0].a.kernel
    assert part.blocks[-1].a.kernel is own[str(len(own) - 1)]["a"]["kernel"]
    j = len(own) // 2
    for loaded in (cases[ONE]["Taktiny"][1](), cases[ONE_FLAT]["Taktiny"][1]()):
        assert loaded.blocks[j].b.bias is new.blocks[j].b.bias  # the other model's
        assert loaded.blocks[j - 1].a.kernel is own[str(j - 1)]["a"]["kernel"]  # untouched
    swapped = cases[SWAP]["Taktiny"][1]()
    assert swapped.blocks[j] is not part.blocks[j] and len(swapped.blocks) == len(own)


def run(config: Config) -> Group:
    """Times every state call on both model sizes and checks the issue's targets."""
    start = time.perf_counter()
    group = Group("state", "State read/write")
    for n in config.pick([64, 500], [64], [2, 5]):
        leaves = n * _models.LEAVES_PER_BLOCK
        table = Table(f"{leaves:,}-leaf model ({n} blocks)", SYSTEMS)
        cases = _cases(n)
        _check(cases)
        for op, systems in cases.items():
            stats = compare({s: fn for s, (_, fn) in systems.items()}, repeat=config.repeat)
            for system, (call, _) in systems.items():
                st = stats[system]
                table.add(op, system, call, st.median, (st.low, st.high))
        group.tables.append(table)
        size = f"{leaves:,} leaves"
        group.targets += [
            Target(
                f"state_dict() faster than PyTorch state_dict() ({size})",
                faster(table, READ, "PyTorch"),
                1.0,
                True,
                "PyTorch time / Taktiny time",
            ),
            Target(
                f"flat_state_dict() faster than PyTorch state_dict() ({size})",
                faster(table, READ, "PyTorch", READ_FLAT),
                1.0,
                True,
                "PyTorch state_dict time / Taktiny flat_state_dict time",
            ),
            Target(
                f"full load_state_dict >= 5x faster than PyTorch load_state_dict ({size})",
                faster(table, LOAD, "PyTorch"),
                5.0,
                True,
                "PyTorch time / Taktiny time",
            ),
            Target(
                f"full load_state_dict >= 10x faster than nnx.update ({size})",
                faster(table, LOAD, "Flax NNX"),
                10.0,
                True,
                "nnx.update time / Taktiny time",
            ),
        ]
        ratios = {
            op: table.value(op, "Taktiny") / table.value(LOAD, "Taktiny")
            for op in (ONE, ONE_FLAT, SWAP)
        }
        group.notes.append(
            f"{size}: one-block load {ratios[ONE]:.3f}x, one-block flat load "
            f"{ratios[ONE_FLAT]:.3f}x, swap one block {ratios[SWAP]:.3f}x of a full load."
        )
        if n >= 500:  # issue 22 states these for the 500-block (3,000-leaf) model
            group.targets += [
                Target(
                    f"state_dict() <= 0.2x PyTorch's state_dict() ({size})",
                    1 / faster(table, READ, "PyTorch"),
                    0.2,
                    False,
                    "Taktiny time / PyTorch time",
                ),
                Target(
                    f"full load_state_dict <= 0.06x PyTorch's load_state_dict ({size})",
                    1 / faster(table, LOAD, "PyTorch"),
                    0.06,
                    False,
                    "Taktiny time / PyTorch time",
                ),
            ]
            group.targets += [
                Target(
                    f"{what} <= 0.01x a full load ({size})",
                    ratios[op],
                    0.01,
                    False,
                    f"Taktiny {what} time / Taktiny full load time",
                )
                for op, what in ((ONE, "one-block load"), (ONE_FLAT, "one-block flat load"))
            ]
    group.notes[:0] = [
        "Full loads load a different model's state (same architecture, another seed); the "
        "partial load supplies the first 10% of the blocks. PyTorch copies into its existing "
        "tensors; nnx.update sets its Variables in place; Taktiny and Equinox return a new model.",
        "NNX split/merge: `nnx.merge(graphdef, state)` with the graphdef taken once beforehand.",
        "One-block load: the six leaves of the middle block, as a nested state (Taktiny, "
        "NNX, PyTorch) or flat (Taktiny's second row); Equinox swaps the block with "
        "`eqx.tree_at`. A Taktiny load of a few leaves walks to them and rebuilds only the "
        "modules on their paths, so it costs about the same on both models (about 25-50 us for "
        "six leaves here). Issue 22's targets (state_dict <= 0.2x and a full load <= 0.06x "
        "PyTorch's, a one-block load <= 0.01x a full load) are stated for the 3,000-leaf "
        "model; on the 384-leaf one, fixed costs weigh more (a full load takes about 0.2 ms), "
        "and only the earlier targets (faster than PyTorch, 5x, 10x) are checked.",
        "Swap one block: `model.replace(blocks=...)` with a list equal to the model's but "
        "for one block; only the swapped block is checked.",
    ]
    group.seconds = time.perf_counter() - start
    return group
