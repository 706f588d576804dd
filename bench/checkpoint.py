"""Checkpoints: saving and restoring a 1 GB model with each system, against the raw disk.

Saves are timed to durable bytes (every file fsynced); restores start from a cold page
cache and end with the model (or state) in memory. Taktiny's state goes through Orbax
beside the very same nested dict handed to Orbax directly, so any gap between the two
is Taktiny's; the raw baseline writes and reads the same bytes with plain numpy file
I/O, the most a format can hope for on this disk.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any

import jax

from . import _disk, _formats
from ._results import Config, Group, Table, Target, fmt_time
from ._timing import Case, compare, paired_ratio

SYSTEMS = list(_formats.SAVE)
RAW, TT, DICT, TUNED, CHUNKED = (
    "raw disk (numpy)",
    "Taktiny + Orbax",
    "dict + Orbax",
    "Taktiny + Orbax tuned",
    "Taktiny + Orbax chunked",
)


def _save_case(root: Path, name: str, save: Any, models: dict[str, Any]) -> Case:
    counter = itertools.count()

    def before() -> Path:
        return root / f"{name}-{next(counter)}"

    def run(path: Path) -> None:
        save(path, models)
        _disk.sync(path)

    def after(path: Path) -> None:
        _disk.remove(path)
        os.sync()  # let the deletion and any writeback settle before the next sample

    return Case(run, before, after)


def _restore_case(path: Path, restore: Any, abstracts: dict[str, Any]) -> Case:
    def before() -> Path:
        os.sync()
        _disk.evict(path)
        return path

    return Case(lambda p: jax.block_until_ready(restore(p, abstracts)), before)


def _targets(table: Table, own: dict[str, float]) -> list[Target]:
    out = []
    for op in ("save", "restore"):
        raw, plain = table.value(op, RAW), table.value(op, DICT)
        out.append(
            Target(
                f"Orbax {op} of Taktiny state within 5% of Orbax on the plain dict",
                (plain + own[op]) / plain,
                1.05,
                False,
                "(dict + Orbax time + Taktiny's own calls) / dict + Orbax time; the wall-clock "
                "ratio is in the notes",
            )
        )
        for system in (TT, TUNED, CHUNKED):
            out.append(
                Target(
                    f"{system} {op} >= 70% of the raw disk baseline",
                    raw / table.value(op, system),
                    0.70,
                    True,
                    "raw-disk time / Orbax time, i.e. share of raw throughput",
                )
            )
    return out


def _taktiny_seconds(models: dict[str, Any], abstracts: dict[str, Any], path: Path) -> Any:
    """Taktiny's own seconds in a save and in a restore through Orbax, timed precisely.

    Taktiny + Orbax hands Orbax the very tree the dict case hands it (checked here), so
    the two differ by exactly these calls: ``state_dict()`` on save; building the target
    with ``state_dict()`` and ``load_state_dict`` of the result on restore.
    """
    model, abstract = models["taktiny"], abstracts["taktiny"]
    same_save = jax.tree.structure(model.state_dict()) == jax.tree.structure(models["dict"])
    plain_target = _formats.plain_dict(abstract)
    same_restore = jax.tree.structure(abstract.state_dict()) == jax.tree.structure(plain_target)
    assert same_save and same_restore, "Taktiny's state and the plain dict must match"
    restored = _formats.restore_orbax(path, abstract.state_dict())

    def restore_calls() -> Any:
        abstract.state_dict()  # the target handed to Orbax
        return abstract.load_state_dict(restored, strict=True)

    stats = compare({"save": model.state_dict, "restore": restore_calls}, repeat=11)
    return {op: st.median for op, st in stats.items()}


def run(config: Config) -> Group:
    """Times every system's save and restore of the big model, and checks the targets."""
    start = time.perf_counter()
    width, depth = _formats.SIZES[config.mode]
    repeat = config.pick(5, 1, 1)
    models = _formats.models(width, depth)
    abstracts = _formats.abstracts(width, depth)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(models["taktiny"]))
    group = Group("checkpoint", f"Checkpoints of a {nbytes / 1e9:.2f} GB model")
    table = Table(
        f"{depth} x Linear({width}, {width}), float32, {nbytes / 1e6:,.0f} MB",
        SYSTEMS,
        reference=TT,
        log=False,
    )
    root = Path(config.scratch)
    root.mkdir(parents=True, exist_ok=True)
    kept = {s: root / f"kept-{i}" for i, s in enumerate(SYSTEMS)}
    paired = {}
    try:
        saves = {
            s: _save_case(root, f"save{i}", fn, models)
            for i, (s, (_, fn)) in enumerate(_formats.SAVE.items())
        }
        stats = compare(saves, repeat=repeat)
        paired["save"] = paired_ratio(stats[TT], stats[DICT])
        for system, st in stats.items():
            table.add("save", system, _formats.SAVE[system][0], st.median, (st.low, st.high))
        for system, (_, save) in _formats.SAVE.items():
            save(kept[system], models)
            _disk.sync(kept[system])
        restores = {
            s: _restore_case(kept[s], fn, abstracts) for s, (_, fn) in _formats.RESTORE.items()
        }
        stats = compare(restores, repeat=repeat)
        paired["restore"] = paired_ratio(stats[TT], stats[DICT])
        for system, st in stats.items():
            table.add("restore", system, _formats.RESTORE[system][0], st.median, (st.low, st.high))
        sizes = {s: _disk.size(p) for s, p in kept.items()}
        own = _taktiny_seconds(models, abstracts, kept[TT])
    finally:
        for path in kept.values():
            _disk.remove(path)
    group.tables.append(table)
    group.targets += _targets(table, own)
    group.notes += [
        f"Model bytes: {nbytes:,}. Checkpoint bytes on disk: "
        + ", ".join(f"{s} {b:,}" for s, b in sizes.items())
        + ".",
        "Saves: a fresh path per sample, every file fsynced before the clock stops (durable "
        "bytes), deleted afterwards. Restores: the checkpoint's pages are dropped from the page "
        "cache (posix_fadvise DONTNEED) before each sample, and the clock stops when every "
        "array is ready. Orbax restores into an abstract model (jax.eval_shape), PyTorch into "
        "a meta-device model with assign=True, so no random init is paid. One warm-up sample "
        f"per case, then {repeat} interleaved samples; the disk is a VM's virtual disk and the "
        "machine is shared, so single samples vary by up to 2x.",
        "Taktiny + Orbax vs dict + Orbax. Orbax gets the identical tree from both (checked), so "
        "they differ only by Taktiny's own calls, timed precisely: "
        f"{fmt_time(own['save'])} per save (state_dict), {fmt_time(own['restore'])} per restore "
        "(state_dict for the target, then load_state_dict), i.e. "
        f"{own['save'] / table.value('save', DICT):.5%} and "
        f"{own['restore'] / table.value('restore', DICT):.5%} of the Orbax time. The wall-clock "
        "ratio of the two, median of per-round ratios, is save "
        f"{paired['save']:.2f}, restore {paired['restore']:.2f}: on this shared machine it is "
        "noise of the size of the sample spread above, far coarser than 5%, which is why the "
        "target is checked on the decomposition.",
        f"Raw baseline throughput: save {nbytes / table.value('save', RAW) / 1e9:.2f} GB/s, "
        f"restore {nbytes / table.value('restore', RAW) / 1e9:.2f} GB/s.",
        f"Orbax tuned = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(**{_formats.TUNED})); "
        f"chunked = tuned, saved with ocp.SaveArgs(chunk_byte_size={_formats.CHUNK_BYTES}) for "
        "every leaf.",
    ]
    group.seconds = time.perf_counter() - start
    return group
