"""Smoke test of the benchmark suite: every group runs once on tiny sizes, so the
benchmarks cannot rot. (The real runs are `make bench` and `make bench-quick`.)"""

import json
import math
import sys
from pathlib import Path

import _loopback
import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ is not installed

from bench import (
    accelerator,
    background_save,
    checkpoint,
    checksums,
    decoding,
    diagnose,
    dispatch,
    errors,
    headers,
    load_overhead,
    load_plan,
    lora,
    memory,
    models,
    quantized,
    report,
    scanned,
    sharded,
    state,
    storage,
    streaming,
)
from bench._results import Config, Group, Skipped, Table, Target
from bench._timing import Case, Stats, compare, paired_ratio

pytestmark = pytest.mark.program

GROUPS = {
    "state": state,
    "dispatch": dispatch,
    "checkpoint": checkpoint,
    "memory": memory,
    "sharded": sharded,
    "streaming": streaming,
    "quantized": quantized,
    "decoding": decoding,
    "errors": errors,
    "checksums": checksums,
    "headers": headers,
    "lora": lora,
    "plan": load_plan,
    "overhead": load_overhead,
    "background": background_save,
    "storage": storage,
    "scanned": scanned,
    "models": models,
}


def check(group: Group) -> None:
    assert group.tables and group.targets
    for table in group.tables:
        assert table.rows
        for row in table.rows.values():
            assert row, table.title
            for cell in row.values():
                positive = cell.value > 0 if table.unit == "s" else cell.value >= 0
                assert math.isfinite(cell.value) and positive, (table.title, cell)
    for target in group.targets:
        assert math.isfinite(target.value) and target.value >= 0, target.goal
        assert isinstance(target.met, bool)


@pytest.fixture
def fast_compile():
    """XLA's optimisations cost more than they save on one call of a tiny step: the smoke
    test only checks that every benchmark runs, not how fast."""
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", False)


# the groups whose smoke runs load in many fresh processes (quantized's: seven, about 40 s),
# compile training steps (dispatch, 16 s; scanned, of the Llama example, which imports
# transformers), or take 10 s or more (headers, memory; models, six fresh processes: 31 s): `make property` runs them, keeping
# `make test` under 12 minutes (storage's, one fresh process and an S3 stub, takes about
# 6 s: it stays in `make test`)
SLOW = ("streaming", "plan", "scanned", "quantized", "dispatch", "headers", "memory", "models")


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.thorough) if n in SLOW else n for n in GROUPS]
)
def test_benchmark_group_runs_on_tiny_sizes(name, tmp_path, request, fast_compile):
    if name in ("dispatch", "lora", "scanned"):  # their training steps use optax's Adam
        request.getfixturevalue("optax_promotion")
    if name == "storage":  # (its S3 stub listens on 127.0.0.1)
        _loopback.needed()
    (tmp_path / "scratch").mkdir()
    group = GROUPS[name].run(Config("smoke", tmp_path / "scratch"))
    check(group)
    assert list((tmp_path / "scratch").iterdir()) == []  # every checkpoint was cleaned up
    out = report.write([group], tmp_path / "report", mode="smoke", seconds=1.0, command="test")
    text = out.read_text()
    assert group.title in text and "## Targets" in text
    assert len(list((tmp_path / "report" / "plots").glob("*.png"))) == len(group.tables)


def test_compare_interleaves_and_takes_medians():
    calls = []
    stats = compare(
        {"a": lambda: calls.append("a"), "b": Case(lambda x: calls.append(x), lambda: "b")},
        repeat=3,
        warmup=1,
        min_sample_s=0.0,
    )
    assert stats["a"].samples and len(stats["b"].samples) == 3
    assert calls[:2] == ["a", "b"]  # warm-up of each, then interleaved rounds
    # the median of per-round ratios, not the ratio of medians (2/1, 3/3, 8/2 -> 2, not 3/2)
    a = Stats(3.0, 2.0, 8.0, (2.0, 3.0, 8.0), 1)
    b = Stats(2.0, 1.0, 3.0, (1.0, 3.0, 2.0), 1)
    assert paired_ratio(a, b) == 2.0 and paired_ratio(b, a) == 0.5


def test_target_direction():
    assert Target("x", 0.9, 1.0, False, "").met and not Target("x", 0.9, 1.0, True, "").met
    table = Table("t", ["Taktiny", "peer"])
    table.add("op", "Taktiny", "f()", 1.0)
    table.add("op", "peer", "g()", 3.0)
    assert table.value("op", "peer") == 3.0


def _group(name: str, value: float) -> Group:
    table = Table(f"{name} table", ["Taktiny", "peer"])
    table.add("op", "Taktiny", "f()", value)
    table.add("op", "peer", "g()", 2 * value, (value, 3 * value))
    return Group(name, f"{name} title", [table], [Target(f"{name} goal", value, 1.0, False, "")])


def test_merged_report_keeps_the_other_groups(tmp_path):
    report.write(
        [_group("a", 0.5), _group("b", 0.25)],
        tmp_path,
        mode="full",
        seconds=9.0,
        command="python bench/run.py",
    )
    # one group run again and merged: the other is kept as it was, with its own run
    report.write(
        [_group("b", 0.75), _group("c", 2.0)],
        tmp_path,
        mode="full",
        seconds=4.0,
        command="python bench/run.py --only b,c --merge",
        merge=True,
    )
    groups = report.load(tmp_path / "results.json")
    assert [g.name for g in groups] == ["a", "b", "c"]
    assert [g.targets[0].value for g in groups] == [0.5, 0.75, 2.0]
    assert groups[0].run == {"command": "python bench/run.py", "mode": "full", "seconds": 9.0}
    assert groups[1].run and groups[1].run["command"].endswith("--merge")
    assert groups[0].tables[0].rows["op"]["peer"].spread == (0.5, 1.5)
    text = (tmp_path / "results.md").read_text()
    assert "a goal" in text and "b goal" in text and "c goal" in text
    # the report's own run is the one most groups come from; the others are named
    assert "`python bench/run.py --only b,c --merge` — mode" in text
    assert "The group `a` (a title) is from `python bench/run.py` (mode full, 9 s)" in text
    assert len(list((tmp_path / "plots").glob("*.png"))) == 3
    # without merge, only the groups given are written
    report.write([_group("c", 2.0)], tmp_path, mode="full", seconds=1.0, command="x")
    assert [g.name for g in report.load(tmp_path / "results.json")] == ["c"]


def test_load_profile_runs(capsys):
    diagnose.profile_load(seconds=0.03, blocks=(2,))
    assert "12 leaves" in capsys.readouterr().out


def test_sharded_profile_runs(capsys):
    diagnose.profile_sharded(seconds=0.03, blocks=2, width=32)
    out = capsys.readouterr().out
    assert "tt.shard, 12 leaves" in out and "Linear(32, 32)" in out


def test_streaming_profile_runs(capsys):
    diagnose.profile_streaming(rounds=1, size=(32, 2))
    out = capsys.readouterr().out
    assert "one posix_fadvise(WILLNEED) over all of" in out and "load_safetensors as is" in out
    assert "preadv (disk wait + copy)" in out and "reader thread 2 ahead" in out


def test_device_pipelines_steps_time_each_shape_of_an_fp8_step(tmp_path, monkeypatch):
    from bench import device_pipelines

    monkeypatch.setattr(device_pipelines, "LAYERS", 4)
    monkeypatch.setattr(device_pipelines, "WIDTH", 256)
    figures = device_pipelines.main(tmp_path, "steps")
    shapes = ["weights", "with_scales", "with_program", "with_scales_and_program"]
    assert sorted(figures) == sorted(
        ["device", *(f"steps_{s}{kept}" for s in shapes for kept in ("", "_kept"))]
    )
    assert all(v > 0 for k, v in figures.items() if k != "device")


def test_device_load_profile_runs_and_puts_back_what_it_timed(tmp_path, monkeypatch):
    import threading

    import taktiny.loading._load as load_module
    from bench import device_load, device_load_profile

    monkeypatch.setattr(device_load, "LAYERS", 2)
    monkeypatch.setattr(device_load, "WIDTH", 256)
    start, pool = threading.Thread.start, load_module.reader_pool
    figures = device_load_profile.profile(tmp_path, ["plain", "fp8_int8"])
    assert threading.Thread.start is start  # (every step unwrapped)
    assert load_module.reader_pool is pool  # (pools of each load's own only for its rounds)
    kept = figures["plain"]["threads_kept"]
    assert kept["kept_GiBps"] > 0 and kept["started_GiBps"] > 0 and kept["kept_vs_started"] > 0
    for case in ("plain", "fp8_int8"):
        main, readers = figures[case]["main"], figures[case]["taktiny-read"]
        assert main["outside the steps timed"] >= 0 and main["waiting for a unit"] > 0
        assert figures[case]["calls"]["main: planning: the steps"] == 1
        assert any(step.startswith("a unit's whole read") for step in readers)
    assert figures["fp8_int8"]["main"]["placing a unit (Transformed)"] > 0


def test_times_read_in_the_unit_that_fits_their_rounded_value():
    from bench._results import fmt_time

    assert [fmt_time(s) for s in (1.234, 0.0456, 789e-6, 0.0009996, 0.99996, 5e-10)] == [
        "1.23 s",
        "45.6 ms",
        "789 µs",
        "1 ms",
        "1 s",
        "0.5 ns",
    ]


def test_device_hbm_reads_copies_each_weight_block_by_block(monkeypatch):
    import jax.numpy as jnp

    from bench import device_hbm_reads as hbm

    monkeypatch.setattr(hbm, "LAYERS", 2)
    monkeypatch.setattr(hbm, "WIDTH", 512)
    monkeypatch.setattr(hbm, "SIZES", ((0.5, jnp.int8), (2, jnp.bfloat16)))
    weights = [
        jnp.arange(512 * 512, dtype=jnp.int32).reshape(512, 512) % (97 + i) for i in range(2)
    ]
    weights = [w.astype(jnp.int8) for w in weights]
    copy = hbm.copying(jnp.int8, 256, interpret=True)  # (two blocks a weight)
    want = sum(w[256:264, :128].astype(jnp.float32) for w in weights)
    assert jnp.array_equal(copy(weights), want)  # (the last block, copied)
    figures = hbm.main()
    assert figures["interpreted"] is True
    for dtype in ("bfloat16", "int8"):
        assert figures[f"xla_sum_{dtype}_GBps"] > 0
        assert all(figures[f"copy_{dtype}_{r}rows_GBps"] > 0 for r in (256, 512))
        assert figures[f"copy_{dtype}_256rows_us_a_weight"] > 0
    assert "copy_int8_1024rows_GBps" not in figures  # (no block larger than the weight)
    sizes = figures["by_size"]
    assert sorted(sizes) == sorted(f"{jnp.dtype(d).name} {int(512 * f)}x512" for f, d in hbm.SIZES)
    assert sizes["int8 256x512"][0] == 0.125 and sizes["bfloat16 1024x512"][0] == 1
    assert all(mib > 0 and rate > 0 and us > 0 and xla > 0 for mib, rate, us, xla in sizes.values())


def test_device_fp8_paths_loads_both_ways_bitwise_and_by_the_load_before(tmp_path, monkeypatch):
    import taktiny.loading._ways as ways
    from bench import device_fp8_paths, device_load

    monkeypatch.setattr(device_load, "LAYERS", 2)
    monkeypatch.setattr(device_load, "WIDTH", 256)
    copies, real = [], ways._from_file
    monkeypatch.setattr(  # (a sharding: a copy by a call of its own)
        ways, "_from_file", lambda t, on, v: (on is not None and copies.append(t)) or real(t, on, v)
    )
    with device_fp8_paths.way("arguments"):
        figures = device_fp8_paths.main(tmp_path, rounds=2)
        assert ways.Fp8Blocks._source is not ways.Transformed._source  # (put back)
    keys = [f"{w}_{t}" for w in device_fp8_paths.WAYS for t in device_fp8_paths.TARGETS]
    assert figures["bitwise"] is True and figures["raw_pipeline_GiBps"] > 0
    assert all(figures[f"{k}_GiBps"] > 0 for k in keys)
    assert len(figures["after"]) >= 4 and all(v > 0 for v in figures["after"].values())
    assert {k.split(" after ")[0] for k in figures["after"]} == set(keys)
    # the "calls" way copied each FP8 tensor by a call of its own: 2 tensors a layer, one
    # load to compile and two timed, into each target
    assert len(copies) == 2 * 2 * 3 * 2


def test_device_load_gaps_times_each_load_and_its_planning_by_what_came_before(
    tmp_path, monkeypatch
):
    import taktiny.loading._load as load_module
    from bench import device_load, device_load_gaps

    monkeypatch.setattr(device_load, "LAYERS", 2)
    monkeypatch.setattr(device_load, "WIDTH", 256)
    monkeypatch.setitem(device_load_gaps.GAPS, "sleep", lambda: None)  # (0.3 s each)
    monkeypatch.setitem(device_load_gaps.GAPS, "gc_sleep", device_load_gaps.GAPS["gc"])
    real = load_module.steps_of
    figures = device_load_gaps.main(tmp_path, rounds=1)
    assert load_module.steps_of is real  # (put back)
    keys = [
        f"{t} after {b}, {g}"
        for t in ("int8", "bf16")
        for b in ("bf16", "int8", "pipeline")
        for g in ("none", "gc", "sleep", "gc_sleep")
    ]
    assert sorted(k for k in figures if " after " in k) == sorted(keys)
    assert all(figures[k]["GiBps"] > 0 and figures[k]["planning_ms"] > 0 for k in keys)
    assert figures["raw_pipeline_GiBps"] > 0


def test_device_load_times_the_next_pipeline_once_the_load_s_file_is_unmapped(tmp_path):
    import mmap
    import os
    import threading
    import time

    from bench import device_load

    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    mapping = mmap.mmap(fd, mmap.PAGESIZE, access=mmap.ACCESS_READ)
    os.close(fd)
    threading.Timer(0.2, mapping.close).start()  # (as a load's reader thread unmaps)
    start = time.perf_counter()
    device_load._unmapped(path)
    assert mapping.closed and 0.15 < time.perf_counter() - start < 1.5
    start = time.perf_counter()
    device_load._unmapped(path)  # (nothing mapped: at once)
    assert time.perf_counter() - start < 0.1


def test_device_windows_loads_with_each_window_bitwise_and_puts_it_back(tmp_path, monkeypatch):
    import taktiny.io._storage as storage
    from bench import device_load, device_windows

    monkeypatch.setattr(device_load, "LAYERS", 2)
    monkeypatch.setattr(device_load, "WIDTH", 256)
    windows = {k: device_windows.WINDOWS[k] for k in ["window_64MiB", "window_1GiB"]}
    monkeypatch.setattr(device_windows, "WINDOWS", windows)  # (two of the three)
    seen = []  # (the window each mapping was asked with)
    real = storage.OpenFile.mapped
    monkeypatch.setattr(
        storage.OpenFile, "mapped", lambda *a: seen.append(storage.MAP_WINDOW) or real(*a)
    )
    before = storage.MAP_WINDOW
    figures = device_windows.main(tmp_path, rounds=1)
    assert storage.MAP_WINDOW == before  # (put back)
    assert figures["bitwise"] is True
    assert set(windows.values()) <= set(seen)  # (each, mapped with)
    for window in windows:
        assert sorted(figures[window]) == ["fp8_bf16", "fp8_int8", "plain"]
        assert all(f["GiBps"] > 0 and f["vs_raw_pipeline"] > 0 for f in figures[window].values())


@pytest.mark.parametrize("variant", ["stack_adam_in_backward", "stack_adam_in_backward_carried"])
def test_device_scanned_updates_each_layer_in_the_backward_scan_as_optax_adam_does(
    optax_promotion, variant
):
    from bench import device_scanned

    found = device_scanned.variants(smoke=True)
    stack, forward = found["stack"]
    assert found[variant][0] is stack
    ids = jax.random.randint(jax.random.key(1), (2, 17), 0, 1024)
    want_step, want = device_scanned.step_and_state(forward, stack)
    step, state = device_scanned.step_and_state(found[variant][1], stack)
    assert step is found[variant][1]
    want_model = got_model = stack
    for _ in range(3):  # (Adam's bias corrections differ from step to step)
        want_model, want, want_loss = jax.jit(want_step)(want_model, want, ids)
        got_model, state, loss = jax.jit(step)(got_model, state, ids)
        assert jnp.allclose(loss, want_loss, rtol=1e-6)
    assert jax.tree.structure(got_model) == jax.tree.structure(stack)
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), want_model, stack)
    apart = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), got_model, want_model)
    assert min(jax.tree.leaves(moved)) > 1e-5 and max(jax.tree.leaves(apart)) < 1e-6
    assert int(state[0]) == 3 and jax.tree.structure(state[1]) == jax.tree.structure(stack)


def test_device_map_costs_copies_every_byte_each_way_and_unmaps_as_it_says(tmp_path, monkeypatch):
    from bench import device_map_costs as costs

    monkeypatch.setattr(costs, "SIZE", 40 * 2**20)  # (pieces of 16, 16 and 8 MiB)
    monkeypatch.setattr(costs, "WINDOW", 16 * 2**20)  # (three windows, the last cut short)
    figures = costs.main(tmp_path, rounds=2)
    ways = ("mapped_whole", "mapped_windows", "mapped_populate")
    assert figures["bitwise"] is True and figures["still_held"] == 0
    assert all(figures[f"{w}_GiBps"] > 0 and figures[f"{w}_vs_pipeline"] > 0 for w in ways)
    assert figures["pipeline_GiBps"] > 0 and figures["unmap_ms"] > 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.thorough  # (three processes of their own, about 20 s)
def test_device_load_ab_alternates_two_versions_each_in_its_own_process(
    tmp_path, monkeypatch, capsys
):
    import shutil

    from bench import device_load_ab

    before = tmp_path / "before"
    shutil.copytree(device_load_ab.ROOT / "taktiny", before / "taktiny")
    monkeypatch.setenv("DEVICE_LOAD_LAYERS", "2")
    monkeypatch.setenv("DEVICE_LOAD_WIDTH", "256")
    device_load_ab.main([str(tmp_path / "files"), str(before), "1"])
    lines = capsys.readouterr().out.splitlines()
    runs = [json.loads(line[3:]) for line in lines if line.startswith("AB ")]
    assert [r["label"] for r in runs] == ["before", "after"]
    assert runs[0]["taktiny"] == str(before / "taktiny")  # each its own version
    assert runs[1]["taktiny"] == str(device_load_ab.ROOT / "taktiny")
    assert all(r[k] > 0 for r in runs for k in (*device_load_ab.LOADS, "pipeline_fp8"))
    assert any(line.startswith("after: median GiB/s") for line in lines)


def test_s3_stub_speaks_enough_s3(tmp_path, monkeypatch):
    """The storage group's server answers what obstore and Taktiny ask of S3: HEAD, ranged
    GETs, If-Match (412 on another ETag), a listing by prefix and delimiter."""
    import obstore
    import obstore.exceptions
    from obstore.store import from_url

    import taktiny.io as tio

    _loopback.needed()
    from bench._s3_stub import Stub

    data = bytes(range(256)) * 64
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.bin").write_bytes(data)
    tio.save_safetensors(tmp_path / "model.safetensors", {"w": np.arange(6, dtype=np.float32)})
    with Stub(tmp_path) as stub:
        for name, value in stub.environment().items():
            monkeypatch.setenv(name, value)
        store = from_url("s3://any", client_options={"allow_http": True})
        meta = obstore.head(store, "sub/x.bin")
        assert meta["size"] == len(data) and meta["e_tag"]
        assert bytes(obstore.get_range(store, "sub/x.bin", start=10, end=300)) == data[10:300]
        ok = {"if_match": meta["e_tag"], "range": (5, 9)}
        assert bytes(obstore.get(store, "sub/x.bin", options=ok).bytes()) == data[5:9]
        with pytest.raises(obstore.exceptions.PreconditionError):
            obstore.get(store, "sub/x.bin", options={"if_match": '"other"'})
        with pytest.raises(FileNotFoundError):
            obstore.head(store, "nothing")
        top = obstore.list_with_delimiter(store, None)
        assert top["common_prefixes"] == ["sub"]
        assert [o["path"] for o in top["objects"]] == ["model.safetensors"]
        assert [o["path"] for o in obstore.list_with_delimiter(store, "sub")["objects"]] == [
            "sub/x.bin"
        ]
        flat = tio.load_safetensors({"w": np.zeros(6, np.float32)}, "s3://any/", progress=False)
        assert np.array_equal(np.asarray(flat["w"]), np.arange(6, dtype=np.float32))


def _accelerator_figures() -> dict:
    """What bench/accelerator.json holds after a run on an accelerator (made-up figures)."""
    seconds = {"d2h": 0.5, "d2h_serial": 0.9, "raw_pipelined": 2.0, "raw_serial": 2.4}
    seconds |= {"save": 2.2, "background": 0.55, "background_total": 2.3}
    training = {"step_seconds": 0.04, "every": 250, "steps": 750, "saves": 2}
    training |= {"loop_seconds": {"background": 31.0, "none": 30.0}}
    training |= {"stall_per_save_seconds": 0.5, "training_vs_none": 1.03}
    save = {"GiB": 1.0, "layers": 32, "width": 4096, "filesystem": "ext4 (/dev/sda1 on /)"}
    save |= {"rounds": 5, "seconds": seconds, "GiBps": {k: 1 / v for k, v in seconds.items()}}
    save |= {"raw": "raw_pipelined", "d2h_reference": "d2h", "save_vs_raw": 0.91}
    save |= {"background_vs_d2h": 1.1, "training_vs_none": 1.03, "training": training}
    save |= {"save_bitwise": True, "background_bitwise": True}
    load = {"GiB": 1.0, "raw_read_GiBps": 5.3, "raw_device_put_GiBps": 11.5}
    load |= {"taktiny_GiBps": 3.2, "taktiny_bitwise": True, "taktiny_vs_raw_limit": 0.6}
    quantized = {"device": "TPU v5 lite", "layers": 32, "width": 4096}
    for batch, int8, int4 in ((1, 0.55, 0.4), (16, 0.58, 0.3), (256, 0.9, 1.1)):
        row = {"bf16_ms": 2.0}
        for name, ratio in (("int8_product", int8), ("int8_weight_first", 0.7),
                            ("int4_g128_product", int4), ("int4_g128_weight_first", 0.9),
                            ("int4_g128_group_products", 0.5)):  # fmt: skip
            row |= {f"{name}_ms": 2.0 * ratio, f"{name}_vs_bf16": ratio, f"{name}_close": True}
        quantized[f"batch_{batch}"] = row
    lora = {"device": "TPU v5 lite", "rows": 2048, "full": {"step_ms": 50.0, "peak_bytes": 8e9}}
    for name, ms in (("lora", 30.0), ("qlora_int8", 28.5), ("qlora_int4_g128", 36.0)):
        lora[name] = {"step_ms": ms, "peak_bytes": 2e9, "x_full": ms / 50, "x_lora": ms / 30}
    scanned = {"device": "TPU v5 lite"}
    for name, ms, compile_s, temp in (("unrolled", 30.0, 80.0, 3000.0), ("stack", 39.0, 8.0, 2700.0),
                                      ("stack_remat_dots", 36.0, 9.0, 2000.0)):  # fmt: skip
        scanned[name] = {"step_ms": ms, "compile_s": compile_s, "x_unrolled": ms / 30}
        scanned[name] |= {"temp_MiB_twice_the_tokens": temp}
    return {
        "device": "TPU v5 lite",
        "platform": "tpu",
        "jax": "0.10.2",
        "date": "2026-12-06",
        "command": "python bench/run.py --only accelerator --out /tmp/report",
        "seconds": 300.0,
        "save": save,
        "load": load,
        "quantized": quantized,
        "lora": lora,
        "scanned": scanned,
    }


def test_the_accelerator_group_is_skipped_on_a_cpu_without_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(accelerator, "FIGURES", tmp_path / "accelerator.json")
    monkeypatch.delenv(accelerator.ON_CPU, raising=False)
    with pytest.raises(Skipped, match=r"no accelerator \(JAX's default device is cpu\)"):
        accelerator.run(Config("smoke", tmp_path))


def test_the_accelerator_group_reports_the_last_run_on_one_from_a_cpu(tmp_path, monkeypatch):
    figures = _accelerator_figures()
    monkeypatch.setattr(accelerator, "FIGURES", tmp_path / "accelerator.json")
    accelerator.FIGURES.write_text(json.dumps(figures))
    monkeypatch.delenv(accelerator.ON_CPU, raising=False)
    group = accelerator.run(Config("smoke", tmp_path))
    check(group)
    assert group.run and group.run["command"] == figures["command"]  # (that run's, not this)
    # the load, the three saves, then int8 (decode, 256) and int4 (decode: 0.4 > 0.35; 256),
    # LoRA against full fine-tuning, QLoRA int8 and int4 against LoRA (1.2x), the scanned
    # step (1.3x), its compile (0.1x) and its memory at twice the tokens (0.9x)
    met = [False, True, True, True, True, True, False, False, True, True, False]
    assert [t.met for t in group.targets] == [*met, False, True, True]
    assert group.targets[-3].value == pytest.approx(1.3)
    assert group.targets[-1].value == pytest.approx(0.9)
    step = next(t for t in group.tables if t.title.startswith("A Llama training step"))
    assert step.value("its compile", "nn.Stack") == 8.0
    twins = accelerator.build(figures, {"lora": 0.49, "scanned": 1.11}).tables[-1]
    assert twins.value("scanned step / unrolled (<= 1.05)", "CPU twin") == 1.11
    assert twins.value("LoRA step / full fine-tuning's (<= 0.75)", "TPU v5 lite") == 0.6
    assert "all within it" in " ".join(group.notes)
    forward = next(t for t in group.tables if t.title.startswith("A forward through 32"))
    assert forward.value("batch 16", "int4_g128, product") == pytest.approx(0.6e-3)
    ratios = group.tables[-1]
    assert ratios.value("the background call / the device-to-host copy (<= 1.2)", "TPU v5 lite")
    out = report.write([group], tmp_path / "report", mode="full", seconds=1.0, command="x")
    text = out.read_text()
    assert "## Loads, saves and training on an accelerator: TPU v5 lite" in text
    assert "`python bench/run.py --only accelerator --out /tmp/report` — mode" in text
    for row in (r for k, r in figures["quantized"].items() if k.startswith("batch_")):
        for key in [k for k in row if k.endswith("_close")]:
            del row[key]  # (figures of a run whose check was left out)
    row = figures["quantized"]["batch_16"]  # a candidate that failed at one batch only
    row["int4_g128_group_products_error"] = "JaxRuntimeError: refused"
    del row["int4_g128_group_products_ms"], row["int4_g128_group_products_vs_bf16"]
    built = accelerator.build(figures, {})
    notes = " ".join(built.notes)
    assert "not recorded in this run" in notes and "all within it" not in notes
    assert "group_products at batch 16 failed: JaxRuntimeError: refused" in notes
    forward = next(t for t in built.tables if t.title.startswith("A forward through 32"))
    assert forward.value("batch 1", "int4_g128, group products") == pytest.approx(1e-3)
    with pytest.raises(KeyError):
        forward.value("batch 16", "int4_g128, group products")


@pytest.mark.thorough
def test_the_accelerator_group_runs_small_on_a_cpu_when_asked(
    tmp_path, monkeypatch, optax_promotion
):
    monkeypatch.setattr(accelerator, "FIGURES", tmp_path / "accelerator.json")
    monkeypatch.setenv(accelerator.ON_CPU, "1")
    (tmp_path / "scratch").mkdir()
    group = accelerator.run(Config("smoke", tmp_path / "scratch"))
    check(group)
    assert len(group.targets) == 22 and "read back bitwise equal" in " ".join(group.notes)
    cases = next(t for t in group.tables if t.title.startswith("Loads through rules"))
    assert set(cases.rows) == set(accelerator.CASES.values())  # each against its own file
    assert all(set(row) == set(cases.systems) for row in cases.rows.values())
    assert list((tmp_path / "scratch").iterdir()) == []
    assert not accelerator.FIGURES.exists()  # (figures of a CPU are not kept)
