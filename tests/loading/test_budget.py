"""load_safetensors(max_host_bytes=...): a load within a budget of host memory beyond the
model's arrays. Measured, not only counted: the scratch buffers a load maps, the
intermediate arrays its transforms make and the bytes of the reads it runs at once are
tracked by instrumenting where they are made, and their peak held against the budget and
against what plan_load predicts; a budget one step cannot fit in is refused before any
tensor byte is read."""

import gc
import mmap
import threading
import time
import types
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import taktiny.loading._load as load_module
import taktiny.loading._place as place
import taktiny.loading._ways as ways_module
from taktiny import convert as cv
from taktiny.io import Tensor, load_safetensors, plan_load, save_safetensors

MiB = 2**20
SHAPE = (1024, 2048)  # float32: 8 MiB a tensor
NAMES = [f"w{k}" for k in range(4)]
# transposed then cast: the transpose's float32 result (8 MiB) is an intermediate, the
# cast's bfloat16 result the leaf
RULES = [cv.Rule("{n}", "{n}", cv.chain(cv.transpose(), cv.cast(jnp.bfloat16)))]
TOLERANCE = 0.05  # plan_load's held_bytes: at least the measured peak, at most this above


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    rng = np.random.default_rng(0)
    values = {n: rng.standard_normal(SHAPE, np.float32) for n in NAMES}
    path = tmp_path_factory.mktemp("budget") / "w.safetensors"
    save_safetensors(path, values)
    return values, path


def target():
    return {n: jax.ShapeDtypeStruct(SHAPE[::-1], jnp.bfloat16) for n in NAMES}


class Live:
    """Bytes of host memory alive now, and the most at once: each object counted from
    when it is made until Python frees it."""

    def __init__(self):
        self.now = self.peak = 0
        self.made = 0  # objects counted
        self.lock = threading.Lock()

    def count(self, obj, nbytes):
        with self.lock:
            self.now += nbytes
            self.made += 1
            self.peak = max(self.peak, self.now)
        weakref.finalize(obj, self._free, nbytes)
        return obj

    def _free(self, nbytes):
        with self.lock:
            self.now -= nbytes

    def reset(self):
        gc.collect()  # (JAX lets go of the arrays it adopted from a buffer at a collection)
        assert self.now == 0, f"{self.now:,} bytes still alive"
        self.peak = self.made = 0


@pytest.fixture
def live(monkeypatch):
    """Counts every scratch buffer the load maps (its mapped size) and every intermediate
    array of the rules' chains (the transpose's results; the cast's are the leaves)."""
    live = Live()

    def mapped(fileno, length, *args, **kwargs):
        return live.count(mmap.mmap(fileno, length, *args, **kwargs), length)

    monkeypatch.setattr(place, "mmap", types.SimpleNamespace(mmap=mapped))
    one = cv.transpose.one

    def transposed(self, array):
        out = one(self, array)
        if isinstance(out, jax.core.Tracer):  # (shapes worked out: no memory)
            return out
        return live.count(out, out.nbytes)

    monkeypatch.setattr(cv.transpose, "one", transposed)
    return live


def _same(a, b):
    return all(
        a[n].dtype == b[n].dtype and np.asarray(a[n]).tobytes() == np.asarray(b[n]).tobytes()
        for n in NAMES
    )


def test_a_transforming_load_stays_within_its_budget_and_plan_load_predicts_its_peak(saved, live):
    values, path = saved
    budget = 20 * MiB
    # without a budget: two scratch buffers of 8 MiB, and an 8 MiB intermediate
    unbudgeted = load_safetensors(target(), path, rules=RULES)
    free_peak = live.peak
    assert free_peak == 24 * MiB > budget  # (what the budget has to change)
    live.reset()
    loaded = load_safetensors(target(), path, rules=RULES, max_host_bytes=budget)
    measured, mapped = live.peak, live.made
    assert measured <= budget
    assert measured == 16 * MiB  # one scratch buffer, and one intermediate at a time
    assert mapped == 1 + len(NAMES)  # one buffer, mapped once; the intermediates
    assert _same(loaded, unbudgeted)
    want = {n: jnp.asarray(v.T).astype(jnp.bfloat16) for n, v in values.items()}
    assert _same(loaded, want)
    # the plan's peak under the budget, and without one, bound what the loads measured
    for limit, peak in [(budget, measured), (None, free_peak)]:
        plan = plan_load(target(), path, rules=RULES, max_host_bytes=limit)
        assert plan.ok and plan.max_host_bytes == limit
        assert peak <= plan.held_bytes <= peak * (1 + TOLERANCE), (limit, plan.held_bytes)
    assert plan_load(target(), path, rules=RULES, max_host_bytes=budget).scratch_bytes == 8 * MiB
    assert plan.scratch_bytes == 16 * MiB  # (two buffers without the budget)


def test_a_budget_as_a_string_is_save_safetensors_size(saved, live):
    _, path = saved
    loaded = load_safetensors(target(), path, rules=RULES, max_host_bytes="0.02GB")
    assert live.peak == 16 * MiB <= 20 * 10**6
    assert set(loaded) == set(NAMES)
    plan = plan_load(target(), path, rules=RULES, max_host_bytes="20MiB")
    assert plan.max_host_bytes == 20 * MiB and plan.held_bytes == 16 * MiB
    assert "max_host_bytes 20,971,520" in str(plan)


@pytest.mark.parametrize(
    ("given", "error"),
    [
        ("5 parsecs", r"load_safetensors: max_host_bytes '5 parsecs' is not a size such as"),
        (0, r"load_safetensors: max_host_bytes must be positive, got 0"),
    ],
)
def test_a_budget_that_is_not_a_size_is_refused(saved, given, error):
    _, path = saved
    with pytest.raises(ValueError, match=error):
        load_safetensors(target(), path, rules=RULES, max_host_bytes=given)
    with pytest.raises(ValueError, match=error.replace("load_safetensors", "plan_load")):
        plan_load(target(), path, rules=RULES, max_host_bytes=given)


@pytest.fixture
def no_reads(monkeypatch):
    """Every read of tensor bytes, logged by name: the load's own names for them (bound
    from the io package's face at import) and Tensor's methods."""
    log = []

    def logged(name, real):
        def call(*args, **kwargs):
            log.append(name)
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(
        ways_module, "read_together", logged("read_together", ways_module.read_together)
    )
    monkeypatch.setattr(place.Scratch, "read", logged("Scratch.read", place.Scratch.read))
    for name in ("read", "read_into", "read_blocks", "read_transposed", "verify"):
        monkeypatch.setattr(Tensor, name, logged(f"Tensor.{name}", getattr(Tensor, name)))
    return log


def test_a_budget_one_step_cannot_fit_in_is_refused_before_a_byte_is_read(saved, no_reads):
    _, path = saved
    error = (
        r"max_host_bytes=10,485,760 \(10\.0 MiB\) is too small for 'w0' \(into 'w0'\): "
        r"loading it needs 16,777,216 bytes \(16\.0 MiB\) of host memory beyond the "
        r"model's arrays \(a scratch buffer of 8,388,608 bytes for its sources; 8,388,608 "
        r"bytes of arrays its transform makes that are not leaves\)\. Nothing was read\. "
        r"Raise max_host_bytes to at least 16,777,216"
    )
    with pytest.raises(ValueError, match=error):
        load_safetensors(target(), path, rules=RULES, max_host_bytes=10 * MiB)
    assert no_reads == []
    plan = plan_load(target(), path, rules=RULES, max_host_bytes="10MiB")
    assert not plan.ok and len(plan.problems) == 1
    assert "'w0' (into 'w0')" in plan.problems[0]
    assert "at least 16,777,216" in plan.problems[0] and "10,485,760" in plan.problems[0]
    assert no_reads == []
    # the bytes it names are enough
    loaded = load_safetensors(target(), path, rules=RULES, max_host_bytes=16 * MiB)
    assert set(loaded) == set(NAMES) and "Scratch.read" in no_reads


def test_reads_in_flight_stay_within_the_budget(tmp_path, monkeypatch):
    """Tensors read whole for leaves on eight devices go through a host buffer each, which
    counts until it is placed: a budget of one and a half lets one read run at a time,
    where the load's two readers otherwise run two."""
    rng = np.random.default_rng(1)
    values = {f"t{k}": rng.standard_normal(MiB // 4, np.float32) for k in range(6)}  # 1 MiB
    path = tmp_path / "t.safetensors"
    save_safetensors(path, values)
    everywhere = NamedSharding(jax.make_mesh((8,), ("x",)), P())
    model = {
        n: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=everywhere) for n, v in values.items()
    }
    reading = {"now": 0, "peak": 0}
    lock = threading.Lock()
    read = Tensor.read

    def slow(self, *args, **kwargs):  # (slow enough that two readers overlap)
        with lock:
            reading["now"] += self.nbytes
            reading["peak"] = max(reading["peak"], reading["now"])
        try:
            time.sleep(0.2)
            return read(self, *args, **kwargs)
        finally:
            with lock:
                reading["now"] -= self.nbytes

    monkeypatch.setattr(Tensor, "read", slow)
    free = load_safetensors(model, path)
    assert reading["peak"] == 2 * MiB
    reading["peak"] = 0
    budget = 3 * MiB // 2
    loaded = load_safetensors(model, path, max_host_bytes=budget)
    assert reading["peak"] == MiB <= budget
    for name, value in values.items():
        assert np.asarray(loaded[name]).tobytes() == value.tobytes()
        assert np.asarray(free[name]).tobytes() == value.tobytes()
        assert loaded[name].sharding.is_equivalent_to(everywhere, 1)
    plan = plan_load(model, path, max_host_bytes=budget)
    assert plan.held_bytes == MiB
    with pytest.raises(
        ValueError,
        match=r"'t0' \(into 't0'\): loading it needs 1,048,576 bytes .*1,048,576 bytes in flight, not its leaf's",
    ):
        load_safetensors(model, path, max_host_bytes=MiB - 1)
    assert plan_load(model, path).held_bytes == 6 * MiB  # (as many readers as it may use)


def test_the_read_ahead_stays_within_what_the_budget_leaves(saved, monkeypatch):
    _, path = saved
    windows = []
    real = load_module.Readahead

    class Logged(real):
        def reached(self, index):
            windows.append(self.window)
            super().reached(index)

    monkeypatch.setattr(load_module, "Readahead", Logged)
    load_safetensors(target(), path, rules=RULES)
    assert set(windows) == {256 * MiB}
    windows.clear()
    load_safetensors(target(), path, rules=RULES, max_host_bytes=20 * MiB)
    # beside one 8 MiB scratch buffer, and an 8 MiB intermediate while a step is in flight
    assert windows and max(windows) <= 12 * MiB
    assert all(w <= 20 * MiB - 8 * MiB for w in windows)


def test_without_a_budget_the_load_keeps_no_books(saved, monkeypatch):
    """The default (None) builds no Budget: the load runs as it always did."""
    _, path = saved

    def refuse(*args, **kwargs):
        raise AssertionError("a load without a budget built one")

    monkeypatch.setattr(load_module, "Budget", refuse)
    loaded = load_safetensors(target(), path, rules=RULES)
    assert set(loaded) == set(NAMES)


def test_a_budget_of_another_type_is_refused_naming_it(saved, without_type_checks):
    _, path = saved
    with pytest.raises(
        TypeError, match=r"max_host_bytes takes a number of bytes .* got 15000000\.0 \(float\)"
    ):
        load_safetensors(target(), path, rules=RULES, max_host_bytes=1.5e7)  # type: ignore[arg-type]


def test_the_plan_command_plans_within_a_budget(saved, tmp_path, monkeypatch, capsys):
    from taktiny._cli import main

    _, path = saved
    (tmp_path / "budget_models.py").write_text(
        "import jax.numpy as jnp\n"
        "from taktiny import convert as cv\n"
        f"def half():\n    return {{n: jnp.zeros((2048, 1024), jnp.bfloat16) for n in {NAMES!r}}}\n"
        "RULES = [cv.Rule('{n}', '{n}', cv.chain(cv.transpose(), cv.cast(jnp.bfloat16)))]\n"
    )
    monkeypatch.chdir(tmp_path)
    command = ["plan", str(path), "--model", "budget_models:half", "--rules", "budget_models:RULES"]
    assert main(command) == 0
    assert "scratch and steps in flight): 25,165,824 bytes\n" in capsys.readouterr().out
    assert main([*command, "--max-host-bytes", "20MiB"]) == 0
    out = capsys.readouterr().out
    assert "16,777,216 bytes, max_host_bytes 20,971,520" in out and "would succeed" in out
    assert main([*command, "--max-host-bytes", "10485760"]) == 1
    assert "Raise max_host_bytes to at least 16,777,216" in capsys.readouterr().out
    assert main([*command, "--max-host-bytes", "5 parsecs"]) == 2
    assert "--max-host-bytes '5 parsecs' is not a size" in capsys.readouterr().err


def _mesh_leaf(shape, dtype, spec):
    return jax.ShapeDtypeStruct(
        shape, dtype, sharding=NamedSharding(jax.make_mesh((8,), ("x",)), spec)
    )


MIXED = {  # name -> (shape, dtype) in the file
    "inner": ((256, 1024), np.float32),
    "outer": ((512, 256), np.float32),
    "turned": ((64, 1024), np.float32),
    "everywhere": ((128, 128), np.float32),
    "halved": ((96, 512), np.float32),
    "b0": ((64,), np.float32),
    "b1": ((64,), np.float32),
}
CASES = {  # each load's target and rules
    "blocks, whole and together": (
        lambda: {
            "inner": _mesh_leaf((256, 1024), jnp.float32, P(None, "x")),
            "outer": _mesh_leaf((512, 256), jnp.float32, P("x")),
            "turned": jax.ShapeDtypeStruct((64, 1024), jnp.float32),
            "everywhere": _mesh_leaf((128, 128), jnp.float32, P()),
            "halved": jax.ShapeDtypeStruct((96, 512), jnp.bfloat16),
            "b0": jax.ShapeDtypeStruct((64,), jnp.float32),
            "b1": jax.ShapeDtypeStruct((64,), jnp.float32),
        },
        None,
    ),
    "transposed onto eight devices, and a transform": (
        lambda: {
            "inner": _mesh_leaf((1024, 256), jnp.float32, P("x")),
            "outer": jax.ShapeDtypeStruct((256, 512), jnp.float32),
            "turned": _mesh_leaf((1024, 64), jnp.float32, P(None, "x")),
            "everywhere": jax.ShapeDtypeStruct((128, 128), jnp.float32),
            "halved": jax.ShapeDtypeStruct((512, 96), jnp.bfloat16),
            "b0": jax.ShapeDtypeStruct((64,), jnp.float32),
            "b1": jax.ShapeDtypeStruct((64,), jnp.float32),
        },
        [
            cv.Rule("halved", "halved", cv.chain(cv.transpose(), cv.cast(jnp.bfloat16))),
            cv.Rule("b{k}", "b{k}"),
            cv.Rule("{n}", "{n}", cv.transpose()),
        ],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_budget_a_refusal_names_is_enough_and_one_byte_less_is_not(tmp_path, case):
    rng = np.random.default_rng(2)
    values = {n: rng.standard_normal(s).astype(d) for n, (s, d) in MIXED.items()}
    path = tmp_path / "mixed.safetensors"
    save_safetensors(path, values)
    make, rules = CASES[case]
    refused = plan_load(make(), path, rules=rules, max_host_bytes=1)
    assert not refused.ok
    (problem,) = refused.problems
    least = int(problem.split("at least ")[1].split(" ")[0].replace(",", ""))
    assert least > 0
    plan = plan_load(make(), path, rules=rules, max_host_bytes=least)
    assert plan.ok and plan.held_bytes <= least
    free = load_safetensors(make(), path, rules=rules)
    loaded = load_safetensors(make(), path, rules=rules, max_host_bytes=least)
    for name in MIXED:
        assert (
            loaded[name].dtype == free[name].dtype and loaded[name].sharding == free[name].sharding
        )
        assert np.asarray(loaded[name]).tobytes() == np.asarray(free[name]).tobytes(), name
    with pytest.raises(ValueError, match=f"at least {least:,} "):
        load_safetensors(make(), path, rules=rules, max_host_bytes=least - 1)
