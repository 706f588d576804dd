"""Sharding on 8 simulated devices: ``tt.shard`` against one batched ``jax.device_put``, and
restoring a sharded 1 GB model with its Adam state through Orbax, against Taktiny's own calls
around that restore.

Everything runs on a (2, 4) mesh of 8 simulated CPU devices, which JAX must be asked for
before its first use (``bench/run.py`` does it first thing).

- ``tt.shard``: the "many small blocks" models (384 and 3,000 leaves, see ``_models``), on
  one device, placed by four rules (one leaf in six matches none and is replicated), against
  ``jax.device_put(leaves, shardings)`` of the same leaves with the same shardings, worked
  out beforehand: exactly the transfer ``tt.shard`` makes, so the gap is Taktiny's naming,
  matching and rebuilding.
- Restore: the 1 GB model of the checkpoint group and its Adam moments, saved with
  ``StandardCheckpointer``, restored onto sharded targets built by ``tt.eval_shape`` of the
  model's constructor and of ``optax.adam(...).init`` and ``tt.shard``. Orbax's restore with
  those targets is timed from a cold page cache; Taktiny's calls around it (building the
  targets; loading what Orbax returns into the abstract model and optimizer state) are timed
  on their own, as the checkpoint group does, because a 1% difference is far below the noise
  of two restores on a shared machine.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, SingleDeviceSharding

import taktiny as tt
from taktiny import nn

from . import _disk, _formats, _models
from ._results import Config, Group, Table, Target, fmt_time
from ._timing import Case, compare, paired_ratio

MESH_SHAPE, AXES = (2, 4), ("data", "model")
# the small-blocks model: the first kernel split by columns, the second over both axes,
# biases and scales split, and the shifts (one leaf in six) matched by no rule: replicated
BLOCK_RULES = [
    ("blocks.*.a.kernel", (None, "model")),
    ("blocks.*.b.kernel", ("data", "model")),
    ("**.bias", ("model",)),
    ("blocks.*.scale", ("data",)),
]
# the 1 GB model and its optimizer state ("0.mu.layers.3.kernel"): the Adam step count
# matches no rule and is replicated
BIG_RULES = {"**.kernel": ("data", "model"), "**.bias": ("model",)}
SHARD, PUT, PLAN, ABSTRACT = (
    "Taktiny",
    "jax.device_put",
    "tt.sharding_plan alone",
    "Taktiny, abstract model",
)
SHARDED, ONE_DEVICE = "Orbax onto sharded targets", "Orbax onto one device, then tt.shard"
TARGETS, LOADS = "build the sharded targets", "load the restored state"
PLACING = "of the targets: tt.shard and the state dicts alone"


def mesh() -> Mesh:
    """The (2, 4) mesh over 8 CPU devices; a clear error where JAX has fewer."""
    devices = jax.devices("cpu")
    if len(devices) < 8:
        raise RuntimeError(
            f"the sharded benchmarks need 8 CPU devices, JAX has {len(devices)}: call "
            "jax.config.update('jax_num_cpu_devices', 8) before JAX's first use (bench/run.py "
            "does)."
        )
    return jax.make_mesh(MESH_SHAPE, AXES, devices=devices[:8])


def _same_values(got: Any, want: Any) -> bool:
    return np.asarray(got).tobytes() == np.asarray(want).tobytes()


def _shard_table(config: Config, where: Mesh, group: Group) -> Table:
    """tt.shard against one batched jax.device_put of the same leaves and shardings."""
    table = Table(
        f"Placing a model on a {MESH_SHAPE} mesh of 8 CPU devices by 4 rules",
        [SHARD, PUT, PLAN, ABSTRACT],
    )
    for n in config.pick([64, 500], [500], [2]):
        model = _models.build("taktiny", n, 0)
        abstract = jax.eval_shape(lambda model=model: model)
        leaves, treedef = jax.tree.flatten(model)
        plan = tt.sharding_plan(model, BLOCK_RULES, where)
        shardings = treedef.flatten_up_to(plan.shardings)
        placed = tt.shard(model, BLOCK_RULES, where)  # checked once: the rules' placement
        assert all(
            x.sharding == s and _same_values(x, y)
            for x, y, s in zip(jax.tree.leaves(placed), leaves, shardings, strict=True)
        )
        assert len(plan.unmatched) == n  # the shifts (a rule matching nothing would raise)
        calls = {
            SHARD: (
                "tt.shard(model, rules, mesh)",
                lambda m=model: jax.block_until_ready(tt.shard(m, BLOCK_RULES, where)),
            ),
            PUT: (
                "jax.device_put(leaves, shardings) (the plan's shardings, worked out before)",
                lambda xs=leaves, ss=shardings: jax.block_until_ready(jax.device_put(xs, ss)),
            ),
            PLAN: (
                "tt.sharding_plan(model, rules, mesh) (no transfer)",
                lambda m=model: tt.sharding_plan(m, BLOCK_RULES, where),
            ),
            ABSTRACT: (
                "tt.shard(jax.eval_shape(lambda: model), rules, mesh) (no transfer)",
                lambda a=abstract: tt.shard(a, BLOCK_RULES, where),
            ),
        }
        stats = compare({s: fn for s, (_, fn) in calls.items()}, repeat=config.pick(11, 5, 1))
        op = f"{len(leaves):,}-leaf model ({n} blocks)"
        for system, (call, _) in calls.items():
            st = stats[system]
            table.add(op, system, call, st.median, (st.low, st.high))
        group.targets.append(
            Target(
                f"tt.shard of a {len(leaves):,}-leaf model under 2x one batched "
                "jax.device_put of the same leaves with the same shardings",
                paired_ratio(stats[SHARD], stats[PUT]),
                2.0,
                False,
                "tt.shard time / jax.device_put time, median of per-round ratios",
            )
        )
        group.notes.append(
            f"{op}: tt.shard {fmt_time(stats[SHARD].median)}, of which the plan (names, "
            f"rules, checks) {fmt_time(stats[PLAN].median)}; the batched jax.device_put "
            f"{fmt_time(stats[PUT].median)}, {fmt_time(stats[PUT].median / len(leaves))} a leaf."
        )
    return table


def _host_values(target: Any, seed: int) -> Any:
    """Random values for every leaf of `target` (incompressible, as trained weights and Adam
    moments are: Orbax compresses with zstd), committed to the first CPU device."""
    rng = np.random.default_rng(seed)
    device = SingleDeviceSharding(jax.devices("cpu")[0])

    def value(s: jax.ShapeDtypeStruct) -> jax.Array:
        if not s.shape:
            return jax.device_put(np.asarray(1000, s.dtype), device)  # the Adam step count
        return jax.device_put(rng.standard_normal(s.shape, np.float32).astype(s.dtype), device)

    return jax.tree.map(value, target)


def _restore_tables(config: Config, where: Mesh, group: Group) -> list[Table]:
    """Orbax's restore onto sharded targets, and Taktiny's own calls around it."""
    import orbax.checkpoint as ocp

    width, depth = _formats.SIZES[config.mode]

    def targets() -> tuple[Any, Any, dict[str, Any]]:
        """Taktiny's calls before the restore: the abstract sharded model, its optimizer
        state, and the tree Orbax restores into. A new constructor and optimizer each time,
        so that nothing is taken from JAX's trace caches: a program restores once."""
        optimizer = optax.adam(1e-3)
        abstract = tt.eval_shape(lambda: _formats.Big(width, depth, rngs=nn.Rngs(0)))
        abstract = tt.shard(abstract, BIG_RULES, where)
        opt_abstract = tt.eval_shape(optimizer.init, abstract)
        return (
            abstract,
            opt_abstract,
            {"model": abstract.state_dict(), "opt": tt.state_dict(opt_abstract)},
        )

    abstract, opt_abstract, target = targets()
    device = SingleDeviceSharding(jax.devices("cpu")[0])
    on_one = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), target)
    saved = _host_values(target, seed=0)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(saved))
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(saved["model"]))
    root = Path(config.scratch)
    root.mkdir(parents=True, exist_ok=True)
    path = (root / "sharded").absolute()
    try:
        _formats.save_orbax(path, saved)
        _disk.sync(path)
        on_disk = _disk.size(path)
        probes = [
            ("model", "layers", "0", "kernel"),
            ("opt", "0", "nu", "layers", str(depth - 1), "kernel"),
            ("opt", "0", "count"),
        ]
        wanted = {probe: np.asarray(_at(saved, probe)) for probe in probes}
        del saved

        def restore(tree: Any) -> Any:
            with ocp.StandardCheckpointer() as checkpointer:
                return jax.block_until_ready(checkpointer.restore(path, target=tree))

        restored = restore(target)  # checked once: the target's shardings, the saved bits
        model = abstract.load_state_dict(restored["model"], strict=True)
        opt_state = tt.load_state_dict(opt_abstract, restored["opt"], strict=True)
        want = tt.flat_state_dict(target)
        got = tt.flat_state_dict({"model": model, "opt": opt_state})
        assert sorted(got) == sorted(want)
        for name, x in got.items():
            assert x.sharding == want[name].sharding, (name, x.sharding, want[name].sharding)
        assert model.layers[0].kernel is restored["model"]["layers"]["0"]["kernel"]  # no copy
        for probe, value in wanted.items():
            assert _same_values(_at(restored, probe), value), probe

        def loads(state: Any = restored) -> Any:
            """Taktiny's calls after the restore: the restored arrays into the model and
            the optimizer state (strict: every leaf must be there)."""
            return (
                abstract.load_state_dict(state["model"], strict=True),
                tt.load_state_dict(opt_abstract, state["opt"], strict=True),
            )

        unplaced = tt.eval_shape(lambda: _formats.Big(width, depth, rngs=nn.Rngs(0)))

        def placing() -> Any:
            """The targets' calls but the two traces: what is Taktiny's beyond JAX's
            tracing of the constructor and of the optimizer's init."""
            placed = tt.shard(unplaced, BIG_RULES, where)
            return placed.state_dict(), tt.state_dict(opt_abstract)

        own = compare(
            {TARGETS: targets, LOADS: loads, PLACING: placing}, repeat=config.pick(11, 5, 1)
        )
        del restored, model, opt_state, loads  # 3 GB: free before the timed restores

        def cold() -> None:
            os.sync()
            _disk.evict(path)

        cases = {
            SHARDED: Case(lambda _: restore(target), cold),
            ONE_DEVICE: Case(
                lambda _: jax.block_until_ready(tt.shard(restore(on_one), BIG_RULES, where)), cold
            ),
        }
        stats = compare(cases, repeat=config.pick(3, 1, 1))
    finally:
        _disk.remove(path)
    restore_table = Table(
        f"Restore of {depth} x Linear({width}, {width}) and its Adam state, "
        f"{nbytes / 1e6:,.0f} MB, onto a {MESH_SHAPE} mesh",
        [SHARDED, ONE_DEVICE],
        reference=SHARDED,
        log=False,
    )
    calls = {
        SHARDED: "StandardCheckpointer().restore(path, target=sharded_target)",
        ONE_DEVICE: "tt.shard(StandardCheckpointer().restore(path, target=target_on_device_0), "
        "rules, mesh)",
    }
    for system, st in stats.items():
        restore_table.add("restore", system, calls[system], st.median, (st.low, st.high))
    own_table = Table("Taktiny's own calls around the sharded restore", ["Taktiny"], log=False)
    own_table.add(
        TARGETS,
        "Taktiny",
        "tt.shard(tt.eval_shape(lambda: Model(...)), rules, mesh); "
        "tt.eval_shape(optax.adam(1e-3).init, abstract); abstract.state_dict(); "
        "tt.state_dict(opt_abstract)",
        own[TARGETS].median,
        (own[TARGETS].low, own[TARGETS].high),
    )
    own_table.add(
        LOADS,
        "Taktiny",
        "abstract.load_state_dict(restored['model'], strict=True); "
        "tt.load_state_dict(opt_abstract, restored['opt'], strict=True)",
        own[LOADS].median,
        (own[LOADS].low, own[LOADS].high),
    )
    own_table.add(
        PLACING,
        "Taktiny",
        "tt.shard(abstract, rules, mesh); abstract.state_dict(); tt.state_dict(opt_abstract)",
        own[PLACING].median,
        (own[PLACING].low, own[PLACING].high),
    )
    taktiny = own[TARGETS].median + own[LOADS].median
    orbax = stats[SHARDED].median
    group.targets.append(
        Target(
            f"Restoring a sharded {model_bytes / 1e9:.2f} GB model and its Adam state onto 8 "
            "devices: Taktiny's own calls add under 1% to Orbax's restore",
            taktiny / orbax,
            0.01,
            False,
            "(Taktiny's calls before + after the restore) / Orbax restore time",
        )
    )
    group.notes += [
        f"Restore: {model_bytes:,} bytes of model and {nbytes - model_bytes:,} of Adam state "
        f"(two moments and the step count), random values, {on_disk:,} bytes on disk "
        "(StandardCheckpointer, zstd). Before each restore sample the checkpoint's pages "
        "are dropped from the page cache; the clock stops when every array is ready. One "
        f"warm-up sample per case, then {config.pick(3, 1, 1)} interleaved samples.",
        f"Taktiny's own calls: {fmt_time(own[TARGETS].median)} to build the targets (two "
        "traces by tt.eval_shape, one tt.shard, two state dicts) and "
        f"{fmt_time(own[LOADS].median)} to load the restored arrays (they already have the "
        f"targets' shardings, so nothing moves), together {taktiny / orbax:.4%} of Orbax's "
        f"{fmt_time(orbax)}. Each call builds a new constructor and optimizer, so no trace "
        "is cached, as in a program that restores once. Nearly all of the targets' time is "
        "JAX tracing the constructor and optax's init (jax.eval_shape pays the same): "
        f"tt.shard and the state dicts alone take {fmt_time(own[PLACING].median)}.",
        f"Orbax onto one device, then tt.shard: the same checkpoint restored onto device 0, "
        "then placed by the same rules, the way a restore without sharded targets must go; "
        f"{stats[ONE_DEVICE].median / orbax:.2f}x the time of the sharded restore.",
    ]
    if config.mode != "full":
        group.notes.append(
            f"This {config.mode} run restores {nbytes / 1e6:,.0f} MB, not 3.2 GB: Taktiny's "
            "calls take about as long at any size (they trace, and move nothing), so their "
            "share is far larger here than at the 1 GB the target is set for."
        )
    return [restore_table, own_table]


def _at(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def run(config: Config) -> Group:
    """Times tt.shard and the sharded restore, and checks the targets."""
    start = time.perf_counter()
    where = mesh()
    group = Group("sharded", "Sharding on 8 simulated devices")
    group.tables.append(_shard_table(config, where, group))
    group.tables += _restore_tables(config, where, group)
    group.notes.insert(
        0,
        f"Mesh: jax.make_mesh({MESH_SHAPE}, {AXES}) over 8 simulated CPU devices "
        "(jax_num_cpu_devices=8), one process. The small-blocks rules: "
        + ", ".join(f"`{p}` -> {s}" for p, s in BLOCK_RULES)
        + "; the 1 GB model's: "
        + ", ".join(f"`{p}` -> {s}" for p, s in BIG_RULES.items())
        + ". tt.shard starts from a model on device 0.",
    )
    group.seconds = time.perf_counter() - start
    return group
