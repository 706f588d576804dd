"""Each way a load reads a step holds what the budget counts for it, and the plan reports
the same: a checkpoint read in one way alone needs (beside its scratch buffer) the bytes
that way holds, which ``plan_load`` names in its refusal and as its ``held_bytes``, and
which the load itself refuses one byte less of and loads within."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _quantized_files import fp8_folder
from _reads import in_flight
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import taktiny as tt
from taktiny import convert as cv
from taktiny import nn
from taktiny.io import (
    SafetensorsError,
    load_safetensors,
    open_safetensors,
    plan_load,
    save_safetensors,
)

MiB = 2**20


def _on_eight(shape, spec):
    mesh = jax.make_mesh((8,), ("x",))
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))


def _linear():
    return nn.Sequential(nn.Linear(1024, 256, use_bias=False, rngs=nn.Rngs(0)))


class _Stacked(nn.Module):
    def __init__(self, *, rngs):
        self.layers = nn.Stack(
            lambda rngs: nn.Linear(512, 1024, use_bias=False, rngs=rngs), 1, rngs=rngs
        )


TURNED = [cv.Rule("w", "w", cv.transpose())]
# way: (the shapes saved, the target, the rules, the plan's ways, the bytes held)
CASES = {
    "whole, adopted on one CPU device": (
        {"w": (256, 1024)},
        lambda: {"w": jax.ShapeDtypeStruct((256, 1024), jnp.float32)},
        None,
        ["direct"],
        0,
    ),
    "whole, staged for eight devices": (
        {"w": (256, 1024)},
        lambda: {"w": _on_eight((256, 1024), P())},
        None,
        ["direct"],
        MiB,
    ),
    "in blocks, 4 MiB of rows at a time": (
        {"w": (4096, 1024)},
        lambda: {"w": _on_eight((4096, 1024), P("x"))},
        None,
        ["blocks"],
        4 * MiB,
    ),
    "transposed, a piece at a time": (
        {"w": (1024, 4096)},
        lambda: {"w": jax.ShapeDtypeStruct((4096, 1024), jnp.float32)},
        TURNED,
        ["transposed"],
        4 * MiB,
    ),
    "batched with its neighbours: staging and their buffer": (
        {f"b{k}": (64,) for k in range(3)},
        lambda: {f"b{k}": _on_eight((64,), P()) for k in range(3)},
        None,
        ["direct"] * 3,
        2 * 3 * 256,
    ),
    "through a scratch buffer, and the transpose before its cast": (
        {"w": (1024, 4096)},
        lambda: {"w": jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)},
        [cv.Rule("w", "w", cv.chain(cv.transpose(), cv.cast(jnp.bfloat16)))],
        ["scratch"],
        16 * MiB + 16 * MiB,
    ),
    "quantized from the scratch buffer": (
        {"layers.0.kernel": (1024, 256)},
        lambda: tt.quantize(jax.eval_shape(_linear)),
        None,
        ["quantized"],
        MiB,
    ),
    "into a slice of a stack, transposed a piece at a time": (
        {"layers.0.weight": (1024, 512)},
        lambda: jax.eval_shape(lambda: _Stacked(rngs=nn.Rngs(0))),
        [cv.Rule("layers.{i}.weight", "layers.{i}.kernel", cv.transpose())],
        ["transposed"],
        2 * MiB,
    ),
    "FP8 blocks, laid out into the scratch buffer": (
        "fp8",
        lambda: tt.quantize(jax.eval_shape(_linear)),
        "fp8",
        ["quantized"],
        256 * 1024 + 64,  # (float8 weights, and their scales at a multiple of 64 bytes)
    ),
}


def _case(tmp_path, case):
    """`CASES[case]`'s file written into `tmp_path`: its path, and the case's rules."""
    shapes, _, rules, _, _ = CASES[case]
    rng = np.random.default_rng(0)
    if shapes == "fp8":
        path = tmp_path / "fp8"
        fp8_folder(
            {"layers.0.weight": rng.standard_normal((256, 1024), np.float32)},
            path,
            quantized=lambda name: True,
            shards=1,
        )
        rules = cv.linear("layers.0", "layers.0", bias=False)
        return path, cv.quantized_rules(rules, open_safetensors(path))
    path = tmp_path / "w.safetensors"
    save_safetensors(path, {n: rng.standard_normal(s, np.float32) for n, s in shapes.items()})
    return path, rules


@pytest.mark.parametrize("case", list(CASES))
def test_the_bytes_a_way_holds_are_what_the_plan_and_the_load_count(tmp_path, case):
    _, make, _, ways, held = CASES[case]
    path, rules = _case(tmp_path, case)
    plan = plan_load(make(), path, rules=rules)
    assert [s.way for s in plan.steps] == ways
    assert plan.ok and plan.held_bytes == held
    refused = plan_load(make(), path, rules=rules, max_host_bytes=1)
    if held == 0:
        assert refused.ok
        return
    assert f"needs {held:,} bytes" in refused.problems[0]
    with pytest.raises(ValueError, match=f"needs {held:,} bytes"):
        load_safetensors(make(), path, rules=rules, max_host_bytes=held - 1)
    free = load_safetensors(make(), path, rules=rules)
    within = load_safetensors(make(), path, rules=rules, max_host_bytes=held)
    for a, b in zip(jax.tree.leaves(free), jax.tree.leaves(within), strict=True):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("devices", ["as they are", "copying from mapped pages", "staging"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_load_leaves_no_cycles_so_what_it_mapped_is_let_go_as_it_returns(
    tmp_path, monkeypatch, case, devices, platform
):
    """A load's objects (its plan, its ways, the file's mappings, its scratch buffers) are
    freed when it returns, by their counts of references: none is left in a cycle for
    the garbage collector, whose next pass would unmap them in whatever code runs then
    (on a TPU v5e's host, the next load's planning took 11-22 ms, not 3: a pass over
    the process's objects, and the unmapping; bench/FINDINGS.md section 14)."""
    import gc

    _, make, _, _, _ = CASES[case]
    path, rules = _case(tmp_path, case)
    if devices != "as they are":  # (a CPU's adopt host memory; a TPU's copy it)
        _staged_everywhere(monkeypatch, platform, ring=devices == "staging")
    jax.block_until_ready(load_safetensors(make(), path, rules=rules))  # (compiles)
    target = make()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # (what a collection finds, kept in gc.garbage)
    try:
        loaded = jax.block_until_ready(load_safetensors(target, path, rules=rules))
        gc.collect()
        left = [type(o) for o in gc.garbage if type(o).__module__.startswith("taktiny.")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []  # (another thread's garbage, in another library, is not the load's)
    assert jax.tree.structure(loaded) == jax.tree.structure(target)


@pytest.mark.parametrize("devices", ["as they are", "copying from mapped pages", "staging"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_load_lets_go_of_the_host_memory_it_read_into_as_it_ends(
    tmp_path, monkeypatch, case, devices, platform
):
    """JAX holds the host memory a copy onto a device read (the file's mapped pages, the
    scratch buffers, the staging ring), and a scratch buffer a CPU device adopted a view
    of, until its next garbage collection; the load has it let go as it ends
    (`_release`), not in whatever code allocates next: on a TPU v5e's host, the next
    load's planning paid 12-24 ms for the unmapping (bench/FINDINGS.md section 14). With
    Python's collections off, only the load's own may let go: its buffers as it returns
    (JAX drops its last hold of a copy's host array a moment after the copy's array is
    ready, in a thread of its own: checked within the same bound), the file's windows on
    a reader thread right after."""
    import gc
    import weakref

    import taktiny.loading._place as place_module

    _, make, _, _, _ = CASES[case]
    path, rules = _case(tmp_path, case)
    if devices != "as they are":
        _staged_everywhere(monkeypatch, platform, ring=devices == "staging")
    buffers = []  # (each scratch and ring buffer the load maps, weakly)
    real = place_module._mapped
    monkeypatch.setattr(
        place_module, "_mapped", lambda *a: buffers.append(weakref.ref(m := real(*a))) or m
    )
    file = path if path.is_file() else next(path.glob("*.safetensors"))

    def held() -> list[str]:
        with open("/proc/self/maps") as maps:
            pages = [line.split()[0] for line in maps if line.rstrip().endswith(str(file))]
        return pages + [f"buffer {k}" for k, b in enumerate(buffers) if b() is not None]

    jax.block_until_ready(load_safetensors(make(), path, rules=rules))  # (compiles)
    gc.collect()
    buffers.clear()
    gc.disable()
    try:
        loaded = load_safetensors(make(), path, rules=rules)
        for _ in range(1000):  # (within 10 s)
            if not (left := held()):
                break
            time.sleep(0.01)
    finally:
        gc.enable()
    assert left == [], f"still held 10 s after the load: {left}"
    assert jax.tree.structure(loaded) == jax.tree.structure(make())


@pytest.mark.parametrize("held", [False, True], ids=["let go", "a view kept"])
def test_a_load_unmaps_the_file_on_a_reader_thread_while_its_caller_goes_on(
    tmp_path, monkeypatch, platform, held
):
    """The windows of the file a load copied from are unmapped on a reader thread after
    it returns, not in the caller's: unmapping 1 GiB of populated pages takes 35 ms on a
    TPU v5e's host, which held every load up (the plain load of 1 GiB 7.7-7.9 GiB/s,
    against 10.9-11.1 with the unmapping elsewhere; bench/FINDINGS.md section 14). A
    window a view still reads (a `Tensor.mapped` kept) is not unmapped under it."""
    import mmap
    import threading

    closed = []  # (each file mapping's unmapping: its thread, and whether it unmapped)

    class Counted(mmap.mmap):
        def close(self):
            try:
                super().close()
                closed.append((threading.current_thread(), True))
            except BufferError:
                closed.append((threading.current_thread(), False))
                raise

    monkeypatch.setattr(mmap, "mmap", Counted)  # (the storage's windows are made as these)
    _staged_everywhere(monkeypatch, platform, ring=False)
    state = {f"w{i}": np.full((64, 1024), i, np.float32) for i in range(4)}
    path = tmp_path / "m.safetensors"
    save_safetensors(path, state)
    target = {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in state.items()}
    checkpoint = open_safetensors(path)
    kept = checkpoint["w0"].mapped() if held else None  # (a view of the one window)
    loaded = load_safetensors(target, checkpoint)
    for _ in range(1000):
        if closed:
            break
        time.sleep(0.01)
    assert [(thread is threading.current_thread(), unmapped) for thread, unmapped in closed] == [
        (False, not held)
    ]
    if held:  # (the view still reads its pages; they go with it)
        assert kept is not None and float(kept[0, 0]) == 0.0
    for name, value in state.items():
        np.testing.assert_array_equal(np.asarray(loaded[name]), value)


@pytest.mark.parametrize("scratch", [False, True], ids=["read in place", "through scratch"])
def test_only_a_load_that_read_into_host_memory_jax_holds_lets_go_keeping_a_donated_leaf_as_it_is(
    tmp_path, monkeypatch, scratch
):
    """A load lets go (`release`: it waits for its arrays, then collects) only where JAX
    holds host memory it read into: on the CPU, a scratch buffer (a transformed step's),
    not a load read in place. A leaf it keeps as it was is the caller's, done with or not:
    one donated (deleted) is kept as it is, and not waited for (waiting for it raised)."""
    import taktiny.loading._load as load_module

    released = []
    real = load_module.release
    monkeypatch.setattr(load_module, "release", lambda *a: released.append(1) or real(*a))
    arrays = {"a.0": np.arange(6, dtype=np.float32), "a.1": np.ones(4, np.float32)}
    save_safetensors(tmp_path / "a.safetensors", arrays)
    rules = [cv.Rule(["a.0", "a.1"], "a", cv.concatenate())] if scratch else None
    shapes = {"a": 10} if scratch else {"a.0": 6, "a.1": 4}
    target = {n: jnp.zeros(k, jnp.float32) for n, k in {**shapes, "kept": 3}.items()}
    target["kept"].delete()  # (donated to a step that ran)
    loaded = load_safetensors(target, tmp_path / "a.safetensors", rules=rules, strict=False)
    assert released == ([1] if scratch else [])
    assert loaded["kept"] is target["kept"] and loaded["kept"].is_deleted()
    want = {"a": np.concatenate(list(arrays.values()))} if scratch else arrays
    for name, value in want.items():
        np.testing.assert_array_equal(loaded[name], value)


# Pieces of 4 KiB, so that every tensor below is cut into several (the load's own are 8 MiB)
SMALL_PIECES = {"STAGE_PIECE": 4096}


def _views(monkeypatch, ways_module):
    """The ring buffers the loads below read into, one entry per piece (each buffer's id),
    as a list the test reads."""
    mapped = []
    real = ways_module.Scratch.view

    def view(self, nbytes):
        mapped.append(id(self))
        return real(self, nbytes)

    monkeypatch.setattr(ways_module.Scratch, "view", view)
    return mapped


def _starts(monkeypatch):
    """The readers each load below starts with, as a list the test reads."""
    import taktiny.loading._load as load_module

    starts = []

    class Counted(load_module.Readers):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            starts.append(self.width)

    monkeypatch.setattr(load_module, "Readers", Counted)
    return starts


def _staged_everywhere(monkeypatch, platform="cpu", ring=True, **knobs):
    """The loads below read onto devices that copy host memory, with the module constants
    `knobs` set (``RING``, ``STAGE_PIECE``): on a TPU or a GPU (the `platform`'s first
    device is the default, where the targets go) as they are; on the CPU, its devices taken
    as devices that copy. With `ring`, through the staging ring, each local file taken as
    an object in storage is (`Mapped` reads a local one; tests/io's object-storage tests
    read a real one). A CPU device adopts an aligned buffer instead of copying it, so each
    value it adopts from the ring (or from a file's mapped pages) must be copied: a load
    that forgot it would hand out arrays that the next reads overwrite."""
    import taktiny.loading._ways as ways_module

    if platform == "cpu":
        monkeypatch.setattr(ways_module, "_staging", lambda sharding: True)
    if ring:
        monkeypatch.setattr(ways_module, "_local", lambda tensor: False)
    for name, value in knobs.items():
        monkeypatch.setattr(ways_module, name, value)
    return ways_module


def test_a_load_onto_devices_that_copy_reads_through_a_reused_staging_ring(
    tmp_path, monkeypatch, platform
):
    ways_module = _staged_everywhere(monkeypatch, platform, **SMALL_PIECES, RING=3)
    rng = np.random.default_rng(0)
    state = {f"w{i}": rng.standard_normal((64, 40 + i)).astype(np.float32) for i in range(10)}
    path = tmp_path / "m.safetensors"
    save_safetensors(path, state)
    target = {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in state.items()}
    plan = plan_load(target, path)
    assert [s.way for s in plan.steps] == ["staged"] * 10
    slot = 16 * 49 * 4  # pieces of 16 rows: 20 to 25 fit 4 KiB, 16 divide 64
    assert plan.scratch_bytes == 3 * slot
    mapped, starts = _views(monkeypatch, ways_module), _starts(monkeypatch)
    loaded = load_safetensors(target, path)
    assert len(mapped) == 40 and len(set(mapped)) == 3  # 4 pieces each, the ring in turns
    assert starts == [2]
    for name, value in state.items():  # each its own array, none overwritten by a later read
        assert loaded[name].devices() == {jax.devices(platform)[0]}
        np.testing.assert_array_equal(np.asarray(loaded[name]), value)


def _turned(rng, shapes):
    """Tensors of `shapes` saved, and the rules and target that transpose them."""
    state = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    target = {n: jax.ShapeDtypeStruct(v.T.shape, v.dtype) for n, v in state.items()}
    rules = [cv.Rule("{name}", "{name}", cv.transpose())]
    if "cube" in state:
        target["cube"] = jax.ShapeDtypeStruct((7, 30, 9), np.float32)
        rules.insert(0, cv.Rule("cube", "cube", cv.transpose((1, 0, 2))))
    want = {n: v.transpose(1, 0, 2) if n == "cube" else v.T for n, v in state.items()}
    return state, target, rules, want


def test_a_transposed_tensor_onto_devices_that_copy_is_permuted_through_the_staging_ring(
    tmp_path, monkeypatch, platform
):
    _staged_everywhere(monkeypatch, platform, **SMALL_PIECES)
    shapes = {f"w{i}": (64, 40 + i) for i in range(6)}
    shapes |= {"cube": (30, 7, 9), "prime": (67, 40)}  # (prime: a ragged last piece)
    state, target, rules, want = _turned(np.random.default_rng(1), shapes)
    path = tmp_path / "m.safetensors"
    save_safetensors(path, state)
    plan = plan_load(target, path, rules=rules)
    assert [s.way for s in plan.steps] == ["staged"] * 8
    loaded = load_safetensors(target, path, rules=rules)
    for name, value in want.items():  # permuted, none overwritten by a later read
        np.testing.assert_array_equal(np.asarray(loaded[name]), value)


def test_a_leaf_whose_devices_span_processes_is_staged_whole(tmp_path, monkeypatch, platform):
    """(Simulated: each leaf taken as one whose devices span processes.) Each tensor is
    read whole into one buffer of the ring and copied in one piece (no program joins pieces,
    which each process would run on its own); a transposed one is permuted as it is read,
    a piece of rows at a time, which it holds besides the ring."""
    ways_module = _staged_everywhere(monkeypatch, platform, **SMALL_PIECES, RING=2)
    monkeypatch.setattr(ways_module, "_joined", lambda sharding: False)
    shapes = {"w0": (64, 40), "w1": (64, 41), "cube": (30, 7, 9)}
    state, turned, rules, want = _turned(np.random.default_rng(2), shapes)
    path = tmp_path / "m.safetensors"
    save_safetensors(path, state)
    renamed = {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in state.items()}
    largest = -(-state["w1"].nbytes // 64) * 64  # (a buffer holds a tensor whole)
    pieces = sum(v.nbytes for v in state.values())  # (each under 4 MiB: its piece, whole)
    for target, how, temporary, held in [
        (renamed, None, 0, 0),
        (turned, rules, 2 * 4 * MiB, pieces),  # (a 4 MiB piece for each of two readers)
    ]:
        plan = plan_load(target, path, rules=how)
        assert [s.way for s in plan.steps] == ["staged"] * 3
        assert plan.scratch_bytes == 2 * largest + temporary
        assert plan.held_bytes == 2 * largest + held
    mapped = _views(monkeypatch, ways_module)
    for target, how, values in [(renamed, None, state), (turned, rules, want)]:
        mapped.clear()
        loaded = load_safetensors(target, path, rules=how)
        assert len(mapped) == 3 and len(set(mapped)) == 2  # one piece each, the ring in turns
        for name, value in values.items():
            np.testing.assert_array_equal(np.asarray(loaded[name]), value)


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "mapped"])
def test_damaged_bytes_staged_onto_devices_that_copy_fail_the_load(
    tmp_path, monkeypatch, platform, ring
):
    from taktiny.io import SafetensorsError

    _staged_everywhere(monkeypatch, platform, ring, **SMALL_PIECES)
    state = {f"w{i}": np.full((64, 48), i, np.float32) for i in range(4)}
    path = tmp_path / "m.safetensors"
    save_safetensors(path, state)
    data = bytearray(path.read_bytes())
    data[-1] ^= 4  # (w3[-1, -1], in its last piece)
    path.write_bytes(bytes(data))
    target = {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in state.items()}
    with pytest.raises(SafetensorsError, match="the bytes of 'w3' are damaged"):
        load_safetensors(target, path)
    loaded = load_safetensors(target, path, verify=False)  # the check is what refused it
    assert float(loaded["w3"][-1, -1]) != 3.0 and float(loaded["w2"][-1, -1]) == 2.0


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "mapped"])
def test_a_stack_and_a_replicated_leaf_onto_devices_that_copy_are_staged(
    tmp_path, monkeypatch, ring
):
    _staged_everywhere(monkeypatch, "cpu", ring, **SMALL_PIECES)
    mesh = jax.make_mesh((8,), ("x",))
    replicated = NamedSharding(mesh, P())

    class Model(nn.Module):
        def __init__(self, *, rngs):
            self.layers = nn.Stack(lambda rngs: nn.Linear(32, 48, rngs=rngs), 3, rngs=rngs)
            self.out = nn.Linear(48, 40, rngs=rngs)

    model = Model(rngs=nn.Rngs(0))
    path = tmp_path / "layers.safetensors"
    save_safetensors(path, model.flat_state_dict(unstacked=True))  # layers.0.kernel, ...
    target = jax.eval_shape(lambda: Model(rngs=nn.Rngs(1)))
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), target
    )
    plan = plan_load(target, path)
    assert {s.way for s in plan.steps} == {"staged" if ring else "mapped"}
    loaded = load_safetensors(target, path)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(model), strict=True):
        assert a.sharding.is_equivalent_to(replicated, a.ndim)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_staging_ring_shrinks_within_a_budget(tmp_path, monkeypatch, platform):
    _staged_everywhere(monkeypatch, platform, RING=4, STAGE_PIECE=8 * MiB)
    state = {f"w{i}": np.full((256, 256), i, np.float32) for i in range(6)}  # 256 KiB each
    path = tmp_path / "m.safetensors"
    save_safetensors(path, state)
    target = {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in state.items()}
    each = state["w0"].nbytes
    assert plan_load(target, path).scratch_bytes == 4 * each
    assert plan_load(target, path, max_host_bytes=2 * each).scratch_bytes == 2 * each
    loaded = load_safetensors(target, path, max_host_bytes=each)  # one buffer, in turns
    assert [float(loaded[n][0, 0]) for n in state] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert plan_load(target, path, max_host_bytes=each).error is None
    refused = plan_load(target, path, max_host_bytes=each - 1).error
    assert "a staging buffer of 262,144 bytes to copy it onto its devices" in str(refused)
    _staged_everywhere(monkeypatch, platform, STAGE_PIECE=64 * MiB // 1024)  # 64 rows a piece
    assert plan_load(target, path, max_host_bytes=each).scratch_bytes == 4 * each // 4
    loaded = load_safetensors(target, path, max_host_bytes=each // 4)
    assert [float(loaded[n][-1, -1]) for n in state] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_a_local_file_onto_devices_that_copy_is_copied_from_its_mapped_pages(
    tmp_path, monkeypatch, platform
):
    """A renamed or transposed tensor in a local file is copied onto its devices from the
    file's mapped pages: no staging buffer, no host memory held, bitwise. The values are
    the devices' own: bytes written into the file afterwards (in place, which a mapping
    would show) change none of them."""
    ways_module = _staged_everywhere(monkeypatch, platform, ring=False, **SMALL_PIECES)
    shapes = {f"w{i}": (2, 513) for i in range(8)} | {"cube": (30, 7, 9)}
    state, turned, rules, want = _turned(np.random.default_rng(3), shapes)
    path = tmp_path / "m.safetensors"
    save_safetensors(path, state)
    # (4,104 bytes each, 8 past a multiple of 64: one of them starts on a multiple of 64,
    # where a CPU device adopts the mapped memory it is given)
    assert any(t.offset % 64 == 0 for t in open_safetensors(path).values())
    renamed = {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in state.items()}
    for target, how in [(renamed, None), (turned, rules)]:
        plan = plan_load(target, path, rules=how)
        assert [s.way for s in plan.steps] == ["mapped"] * 9
        assert plan.scratch_bytes == plan.held_bytes == 0
    views, starts = _views(monkeypatch, ways_module), _starts(monkeypatch)
    plain, permuted = load_safetensors(renamed, path), load_safetensors(turned, path, rules=rules)
    assert views == []  # (no buffer of the ring taken)
    assert starts == [8, 8]  # (ways_module.MAPPED_START readers from the start)
    size = path.stat().st_size
    with open(path, "r+b") as file:  # every tensor's bytes overwritten, in place
        file.seek(size - sum(v.nbytes for v in state.values()))
        file.write(b"\xff" * (size - file.tell()))
    for name, value in state.items():
        assert plain[name].devices() == {jax.devices(platform)[0]}
        np.testing.assert_array_equal(np.asarray(plain[name]), value)
        np.testing.assert_array_equal(np.asarray(permuted[name]), want[name])


def test_a_file_that_cannot_be_mapped_is_read_whole(tmp_path, monkeypatch, platform):
    from taktiny.io import Tensor

    _staged_everywhere(monkeypatch, platform, ring=False)
    monkeypatch.setattr(Tensor, "mapped", lambda self: None)  # (as on a file system that maps none)
    state = {"w": np.arange(48, dtype=np.float32).reshape(6, 8)}
    path = tmp_path / "m.safetensors"
    save_safetensors(path, state)
    target = {"w": jax.ShapeDtypeStruct((8, 6), np.float32)}
    loaded = load_safetensors(target, path, rules=[cv.Rule("w", "w", cv.transpose())])
    np.testing.assert_array_equal(np.asarray(loaded["w"]), state["w"].T)


def test_an_object_onto_devices_that_copy_is_staged_through_the_ring(s3, tmp_path, monkeypatch):
    ways_module = _staged_everywhere(monkeypatch, ring=False, **SMALL_PIECES, RING=2)
    state = {f"w{i}": np.full((64, 48), i, np.float32) for i in range(3)}
    save_safetensors(f"{s3}/m.safetensors", state)
    target = {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in state.items()}
    plan = plan_load(target, f"{s3}/m.safetensors")
    assert [s.way for s in plan.steps] == ["staged"] * 3
    views = _views(monkeypatch, ways_module)
    loaded = load_safetensors(target, f"{s3}/m.safetensors")
    assert len(views) == 12 and len(set(views)) == 2  # 4 pieces each, the ring in turns
    for name, value in state.items():
        np.testing.assert_array_equal(np.asarray(loaded[name]), value)


def test_a_quantizing_load_onto_devices_that_copy_copies_from_mapped_pages(
    tmp_path, monkeypatch, platform
):
    """Float tensors quantized (or cast) on their way onto devices that copy host memory
    are copied there from their files' mapped pages: no scratch buffer is mapped, and the
    result is what ``tt.quantize`` of the float model gives; damaged bytes still fail the
    load."""
    from taktiny.io import SafetensorsError

    ways_module = _staged_everywhere(monkeypatch, platform, ring=False)
    model = _linear()
    path = tmp_path / "m.safetensors"
    save_safetensors(path, model)
    target = tt.quantize(tt.eval_shape(_linear))
    want = tt.quantize(model)
    plan = plan_load(target, path)
    assert {s.way for s in plan.steps} >= {"quantized"}
    views = _views(monkeypatch, ways_module)
    loaded = load_safetensors(target, path)
    assert views == []  # (the scratch buffer never mapped)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(want), strict=True):
        assert a.devices() == {jax.devices(platform)[0]}
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    data = bytearray(path.read_bytes())
    data[-1] ^= 4
    path.write_bytes(bytes(data))
    with pytest.raises(SafetensorsError, match="are damaged"):
        load_safetensors(target, path)


def test_quantizing_steps_onto_devices_that_copy_take_no_scratch_and_read_together(
    tmp_path, monkeypatch, platform
):
    """Steps whose sources are copied from mapped pages take no scratch buffer: the plan
    counts none, and their reads run several at once, each quantized by its reader (not
    by the load's thread, one step after another), with what ``tt.quantize`` gives."""
    ways_module = _staged_everywhere(monkeypatch, platform, ring=False)
    layers = nn.Sequential(
        *[nn.Linear(256, 256, use_bias=False, rngs=nn.Rngs(i)) for i in range(6)]
    )
    path = tmp_path / "m.safetensors"
    save_safetensors(path, layers)
    target = tt.quantize(tt.eval_shape(lambda: layers))
    plan = plan_load(target, path)
    assert {s.way for s in plan.steps} == {"quantized"} and plan.scratch_bytes == 0
    most = in_flight(monkeypatch, ways_module, "_from_file")
    quantizing = in_flight(monkeypatch, ways_module, "transformed")
    loaded = load_safetensors(target, path)
    assert most[0] >= 2 and quantizing[0] >= 2
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(tt.quantize(layers)), strict=True):
        assert a.devices() == {jax.devices(platform)[0]}
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fp8_blocks_onto_devices_that_copy_are_copied_from_mapped_pages(
    tmp_path, monkeypatch, platform
):
    """FP8 blocks for devices that copy host memory: their weights and scales copied from
    the files' mapped pages by the step's program (no scratch buffer mapped, no copy of
    their own), the weights laid out by the devices; bitwise what the load gives on
    devices that adopt host memory (read through the scratch buffer, laid out on the
    host), into bfloat16 and into int8; the values the devices' own (bytes written into
    the files afterwards change none); their checksums verified on the way."""
    rng = np.random.default_rng(5)
    path = tmp_path / "fp8"
    weights = {f"layers.{i}.weight": rng.standard_normal((256, 384), np.float32) for i in range(2)}
    fp8_folder(weights, path, quantized=lambda name: True, shards=1)
    rules = [r for i in range(2) for r in cv.linear(f"layers.{i}", f"layers.{i}", bias=False)]
    rules = cv.quantized_rules(rules, open_safetensors(path))

    class Layers(nn.Module):
        def __init__(self, *, rngs):
            self.layers = [nn.Linear(384, 256, use_bias=False, rngs=rngs) for _ in range(2)]

    floats = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16),
        tt.eval_shape(lambda: Layers(rngs=nn.Rngs(0))),
    )
    targets = {"bf16": floats, "int8": tt.quantize(floats)}
    with jax.default_device(jax.devices("cpu")[0]):  # (adopting devices: the scratch buffer)
        want = {k: load_safetensors(t, path, rules=rules) for k, t in targets.items()}
    ways_module = _staged_everywhere(monkeypatch, platform, ring=False)
    views = _views(monkeypatch, ways_module)
    copied, real = [], ways_module._from_file
    monkeypatch.setattr(  # (a sharding: copied by a call of its own)
        ways_module,
        "_from_file",
        lambda t, on, v: (on is not None and copied.append(t.name)) or real(t, on, v),
    )
    loaded = {}
    for name, target in targets.items():
        copied.clear()
        loaded[name] = load_safetensors(target, path, rules=rules)
        assert copied == []  # (by the program's arguments)
    assert views == []
    for file in path.glob("*.safetensors"):  # every byte overwritten, in place
        size = file.stat().st_size
        with open(file, "r+b") as handle:
            handle.seek(size - sum(t.nbytes for t in open_safetensors(file).values()))
            handle.write(b"\xff" * (size - handle.tell()))
    for name in targets:
        for a, b in zip(jax.tree.leaves(loaded[name]), jax.tree.leaves(want[name]), strict=True):
            assert a.dtype == b.dtype and a.devices() == {jax.devices(platform)[0]}
            np.testing.assert_array_equal(
                np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)
            )
    sealed = tmp_path / "sealed" / "model.safetensors"  # (with Taktiny's checksums)
    sealed.parent.mkdir()
    stored = {n: t.read(verify=False) for file in path.glob("*.safetensors")
              for n, t in open_safetensors(file).items()}  # fmt: skip
    save_safetensors(sealed, stored)
    header = open_safetensors(sealed)["layers.1.weight"]
    with open(sealed, "r+b") as handle:  # one bit of a weight flipped
        handle.seek(header.offset + 77)
        byte = handle.read(1)[0]
        handle.seek(header.offset + 77)
        handle.write(bytes([byte ^ 0x10]))
    damaged = rf"the bytes of 'layers.1.weight' are damaged: their checksum is [0-9a-f]{{32}}, and the header records {header.checksum}"
    for target in targets.values():
        with pytest.raises(SafetensorsError, match=damaged):
            load_safetensors(target, sealed.parent, rules=rules)


def test_scalars_and_casts_onto_devices_that_copy_are_copied_from_mapped_pages(
    tmp_path, monkeypatch, platform
):
    """A 0-d tensor and a cast one (transformed) copied from mapped pages, checked."""
    _staged_everywhere(monkeypatch, platform, ring=False)
    state = {"scale": np.float32(2.5), "w": np.linspace(-1, 1, 2048, dtype=np.float32)}
    path = tmp_path / "m.safetensors"
    save_safetensors(path, state)
    target = {n: jax.ShapeDtypeStruct(np.shape(v), jnp.bfloat16) for n, v in state.items()}
    assert {s.way for s in plan_load(target, path).steps} == {"scratch"}
    loaded = load_safetensors(target, path)
    for name, value in state.items():
        assert loaded[name].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(loaded[name]), jnp.asarray(value, jnp.bfloat16))


def _odd_bits(seed, shape):
    """bfloat16 values whose bits a program that moves them through float32 loses: finite
    values with subnormals among them (1 in 128), and NaNs of other payloads than the
    canonical one, of both signs."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**16, shape, dtype=np.uint16) & np.uint16(0xFF7F)
    flat = bits.reshape(-1)
    flat[::37] = (flat[::37] & np.uint16(0x807F)) | np.uint16(0x7F81)
    return bits.view(jnp.bfloat16)


def _bits(x):
    return np.asarray(x).view(np.uint16)


def _as_stored_or_as_a_tpu_holds(got, want):
    """Whether each of `got`'s bfloat16 values has `want`'s bits, or is what a TPU's
    programs make of them: a zero for a subnormal, any NaN for a NaN."""
    got, want = np.asarray(got), np.asarray(want)
    same = _bits(got) == _bits(want)
    x, y = got.astype(np.float32), want.astype(np.float32)
    tiny = float(jnp.finfo(jnp.bfloat16).smallest_normal)
    return bool(np.all(same | ((np.abs(y) < tiny) & (x == 0)) | (np.isnan(x) & np.isnan(y))))


def test_bfloat16_subnormals_and_nan_payloads_arrive_as_stored_through_every_way_of_staging(
    tmp_path, monkeypatch, platform
):
    """Through the staging ring, pieces joined on the devices and transposed there, and
    from mapped pages, each bit arrives: the programs that join and transpose move
    bfloat16 as integers (XLA's CPU backend would make a NaN's payload canonical). A TPU's
    programs may flush a bfloat16 subnormal to zero and make a NaN canonical, a bitcast
    from integers included (bench/FINDINGS.md section 14): there a load through a program
    must give each value as stored or as the TPU holds it, and one copied whole from host
    memory, as stored."""
    state = {"w": _odd_bits(0, (64, 48)), "v": _odd_bits(1, (64, 40))}
    path = tmp_path / "m.safetensors"
    save_safetensors(path, state)
    renamed = {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in state.items()}
    turned = {n: jax.ShapeDtypeStruct(v.T.shape, v.dtype) for n, v in state.items()}
    rules = [cv.Rule("{name}", "{name}", cv.transpose())]
    loads = {"mapped": (renamed, None, False), "ring, renamed": (renamed, None, True)}
    loads |= {
        "mapped, transposed": (turned, rules, False),
        "ring, transposed": (turned, rules, True),
    }
    for how, (target, given, ring) in loads.items():
        with monkeypatch.context() as patched:
            _staged_everywhere(patched, platform, ring=ring, **SMALL_PIECES)
            if given is not None:
                assert {s.way for s in plan_load(target, path, rules=given).steps} == {
                    "staged" if ring else "mapped"
                }
            loaded = load_safetensors(target, path, rules=given)
        for name, value in state.items():
            want = value.T if given else value
            if platform == "tpu" and how != "mapped":  # (perhaps joined or permuted by a
                assert _as_stored_or_as_a_tpu_holds(loaded[name], want), how  # program)
            else:
                np.testing.assert_array_equal(_bits(loaded[name]), _bits(want), err_msg=how)


def test_bfloat16_nan_payloads_arrive_as_given_in_the_layers_of_a_stack_and_joined_by_rules(
    tmp_path,
):
    """A stack on eight CPU devices is filled by a program writing each layer into its
    slice (streamed, and by a load of values given some layers, or every layer as JAX
    arrays, written into zeros), and a rule's ``concatenate`` joins
    tensors by XLA: each moves bfloat16 as integers, so each NaN's payload arrives as
    given."""
    mesh = jax.make_mesh((8,), ("x",))

    class Stacked(nn.Module):
        def __init__(self, *, rngs):
            self.layers = nn.Stack(
                lambda rngs: nn.Linear(48, 64, use_bias=False, param_dtype=jnp.bfloat16, rngs=rngs),
                4,
                rngs=rngs,
            )

    sharded = NamedSharding(mesh, P(None, None, "x"))
    model = tt.eval_shape(lambda: Stacked(rngs=nn.Rngs(0)))
    model = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharded), model)
    layers = {f"layers.{i}.kernel": _odd_bits(i, (48, 64)) for i in range(4)}
    save_safetensors(tmp_path / "m.safetensors", layers)
    want = np.stack([v.view(np.uint16) for v in layers.values()])
    loaded = load_safetensors(model, tmp_path / "m.safetensors")
    np.testing.assert_array_equal(_bits(loaded.layers.block.kernel), want)
    some = {n: v for n, v in layers.items() if n != "layers.2.kernel"}
    again = loaded.load_flat_state_dict(some, strict=False)  # (written into a copy)
    np.testing.assert_array_equal(_bits(again.layers.block.kernel), want)
    every = loaded.load_flat_state_dict({n: jnp.asarray(v) for n, v in layers.items()})
    np.testing.assert_array_equal(_bits(every.layers.block.kernel), want)
    save_safetensors(
        tmp_path / "parts.safetensors",
        {"a": layers["layers.0.kernel"], "b": layers["layers.1.kernel"]},
    )
    target = {"w": jax.ShapeDtypeStruct((96, 64), jnp.bfloat16)}
    joined = load_safetensors(
        target, tmp_path / "parts.safetensors", rules=[cv.Rule(["a", "b"], "w", cv.concatenate(0))]
    )
    np.testing.assert_array_equal(_bits(joined["w"]), np.concatenate([want[0], want[1]]))
