"""taktiny.io.load_safetensors and open_safetensors: streamed loads into abstract, concrete
and sharded models (how a sharded load reads: test_sharded.py), rules applied per
tensor, every problem found before a byte of data is read."""

import os
from concurrent.futures import Future

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from _models import MLP, Scaled
from _reads import log_reads
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import taktiny as tt
from taktiny import convert as cv
from taktiny import nn
from taktiny.io import (
    SafetensorsError,
    load_safetensors,
    open_safetensors,
    read_torch,
    save_safetensors,
)


def flat_numpy(tree):
    return {k: np.asarray(v) for k, v in tt.flat_state_dict(tree).items()}


def assert_same(tree, expected):
    got = flat_numpy(tree)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].dtype == value.dtype, name
        assert got[name].tobytes() == value.tobytes(), name


@pytest.fixture
def saved(tmp_path):
    model = MLP(rngs=nn.Rngs(1))
    path = tmp_path / "mlp.safetensors"
    save_safetensors(path, model)
    return model, path


@pytest.fixture
def reads(monkeypatch):
    """Every read from disk: (tensor name, shape read; a list of shapes for blocks read
    together)."""

    def entry(tensor, out):
        return tensor.name, [x.shape for x in out] if isinstance(out, list) else out.shape

    return log_reads(monkeypatch, entry)


def abstract_mlp():
    return jax.eval_shape(lambda: MLP(rngs=nn.Rngs(0)))


def test_loads_into_an_abstract_model_on_the_default_device(saved, reads):
    model, path = saved
    loaded = load_safetensors(abstract_mlp(), path)
    assert_same(loaded, flat_numpy(model))
    for leaf in jax.tree.leaves(loaded):
        assert isinstance(leaf, jax.Array) and leaf.devices() == {jax.devices()[0]}
    assert sorted(name for name, _ in reads) == sorted(tt.flat_state_dict(model))
    x = jnp.ones((2, 32))
    assert np.array_equal(loaded(x), model(x))


def test_loads_into_a_concrete_model_and_leaves_it_as_it_was(saved):
    model, path = saved
    other = MLP(rngs=nn.Rngs(7))
    before = flat_numpy(other)
    loaded = load_safetensors(other, path)
    assert_same(loaded, flat_numpy(model))
    assert_same(other, before)


def test_a_read_gives_a_read_only_array(saved):
    _, path = saved
    checkpoint = open_safetensors(path)
    kernel = np.asarray(checkpoint["input.kernel"])
    assert not kernel.flags.writeable  # a read gives a read-only array: nobody writes to it
    with pytest.raises(ValueError, match="read-only"):
        kernel[0, 0] = 1.0


def test_rules_apply_tensor_by_tensor_and_place_on_the_target_sharding(tmp_path, reads):
    torch_names, path, _ = torch_mlp(tmp_path, steps=np.array(3, np.int64))
    rules = [
        cv.Rule("fc1.{p}", "input.{p}"),
        cv.Rule("fc2.{p}", "output.{p}"),
        cv.Ignore("steps"),
    ]
    rules = [cv.Rule("fc{i}.weight", "{i}", cv.transpose()), *rules]  # (wrong on purpose)
    with pytest.raises(
        cv.ConversionError, match=r"  - '1': produced from \[.*\], but the target has no such leaf"
    ) as caught:
        load_safetensors(abstract_mlp(), path, rules=rules)
    assert not reads  # found from the headers alone
    assert "'input.kernel'" in str(caught.value)  # and still missing
    rules = [
        cv.Rule("fc1.weight", "input.kernel", cv.transpose()),
        cv.Rule("fc2.weight", "output.kernel", cv.transpose()),
        *rules[1:],
    ]
    mesh = jax.make_mesh((8,), ("x",))
    target = tt.shard(abstract_mlp(), [("input.kernel", P(None, "x"))], mesh)
    loaded = load_safetensors(target, path, rules=rules)
    assert np.array_equal(loaded.input.kernel, torch_names["fc1.weight"].T)
    assert np.array_equal(loaded.output.bias, torch_names["fc2.bias"])
    assert loaded.input.kernel.sharding == NamedSharding(mesh, P(None, "x"))
    assert sorted(name for name, _ in reads) == sorted(n for n in torch_names if n != "steps")
    expected = dict(cv.convert(rules, torch_names, target=abstract_mlp()))
    assert_same(loaded, {k: np.asarray(v) for k, v in expected.items()})


def torch_mlp(tmp_path, **more):
    """An MLP's tensors under PyTorch's names, with `more`, in a file; the rules to load it."""
    rng = np.random.default_rng(1)
    tensors = {
        "fc1.weight": rng.normal(size=(64, 32)).astype(np.float32),
        "fc1.bias": rng.normal(size=(64,)).astype(np.float32),
        "fc2.weight": rng.normal(size=(4, 64)).astype(np.float32),
        "fc2.bias": rng.normal(size=(4,)).astype(np.float32),
        **more,
    }
    path = tmp_path / "torch.safetensors"
    safetensors.numpy.save_file(tensors, str(path))
    rules = [
        cv.Rule("fc1.weight", "input.kernel", cv.transpose()),
        cv.Rule("fc2.weight", "output.kernel", cv.transpose()),
        cv.Rule("fc1.bias", "input.bias"),
        cv.Rule("fc2.bias", "output.bias"),
    ]
    return tensors, path, rules


def test_a_load_raises_a_state_dict_error_with_rules_or_without(tmp_path):
    """A name the model does not take is a StateDictError whether the load has rules or
    not (with rules, a ConversionError, its subclass, kept for one release), and is among
    the error's unexpected_keys either way."""
    _, path, rules = torch_mlp(tmp_path, steps=np.array(3, np.int64))
    own = tmp_path / "own.safetensors"
    save_safetensors(own, {**flat_numpy(MLP(rngs=nn.Rngs(0))), "steps": np.array(3)})
    raised = []
    for file, kwargs in ((own, {}), (path, {"rules": rules})):
        with pytest.raises(tt.StateDictError, match=r"  - 'steps': ") as caught:
            load_safetensors(abstract_mlp(), file, **kwargs)
        raised.append(caught.value)
    assert [e.unexpected_keys for e in raised] == [("steps",), ("steps",)]
    assert [e.missing_keys for e in raised] == [(), ()]
    assert type(raised[1]) is cv.ConversionError  # (the old name still catches it)


def test_rules_take_allow_and_ties_and_their_errors_name_the_load(tmp_path):
    tensors, path, rules = torch_mlp(tmp_path, steps=np.array(3, np.int64))
    tensors["fc1.copy"] = tensors["fc1.weight"]
    tensors["fc2.copy"] = tensors["fc2.weight"] + 1
    safetensors.numpy.save_file(tensors, str(path))
    rules.append(cv.Tie("fc1.copy", same_as="fc1.weight"))
    ignore = cv.Ignore("fc2.copy")
    with pytest.raises(
        cv.ConversionError,
        match=r"^taktiny\.io\.load_safetensors\(MLP\): 1 problem; nothing was converted\.\n"
        r"  - 'steps': no rule consumes or ignores this source name",
    ):
        load_safetensors(abstract_mlp(), path, rules=[*rules, ignore])
    loaded = load_safetensors(abstract_mlp(), path, rules=[*rules, ignore],
                              allow={"unused": ["steps"]})  # fmt: skip
    assert np.array_equal(loaded.input.kernel, tensors["fc1.weight"].T)
    assert np.array_equal(loaded.output.bias, tensors["fc2.bias"])
    with pytest.raises(
        cv.ConversionError,
        match=r"^taktiny\.io\.load_safetensors\(MLP\): 1 problem; nothing was converted\.\n"
        r"  - 'fc2\.copy': is tied to 'fc2\.weight', but their values differ\.$",
    ):
        load_safetensors(abstract_mlp(), path, rules=[*rules, cv.Tie("fc2.copy", "fc2.weight")],
                         allow={"unused": ["steps"]})  # fmt: skip


def test_strict_decides_on_what_the_rules_leave_out_as_it_does_without_rules(tmp_path, reads):
    tensors, path, rules = torch_mlp(tmp_path)
    first = [*rules[::2], cv.Ignore("fc2.*")]  # fc1 only: the output layer is left out
    model = MLP(rngs=nn.Rngs(7))
    loaded = load_safetensors(model, path, rules=first, strict=False)  # no allow= needed
    assert np.array_equal(loaded.input.kernel, tensors["fc1.weight"].T)
    assert loaded.output.kernel is model.output.kernel  # kept, as strict=False promises
    with pytest.raises(
        cv.ConversionError,
        match=r"^taktiny\.io\.load_safetensors\(MLP\): 2 problems; nothing was converted\.\n"
        r"  - 'output\.kernel': no rule produces this target leaf; add a Rule, "
        r"or load with strict=False to keep the model's value\.\n",
    ):
        load_safetensors(model, path, rules=first)
    with pytest.raises(tt.StateDictError, match=r"'output\.kernel': not supplied, and the model"):
        load_safetensors(abstract_mlp(), path, rules=first, strict=False)  # none to keep
    with pytest.raises(  # under strict too: the hint offers no strict=False to keep a value
        cv.ConversionError,
        match=r"'output\.kernel': no rule produces this target leaf; add a Rule; the model is "
        r"abstract, so it has no value to keep\.\n",
    ):
        load_safetensors(abstract_mlp(), path, rules=first)
    reads.clear()
    with pytest.raises(  # what allow= lets the rules leave out, strict refuses, before a read
        tt.StateDictError,
        match=r"^taktiny\.io\.load_safetensors\(MLP\): 2 problems(?s:.)*'output\.bias': missing: strict=True",
    ):
        load_safetensors(model, path, rules=first, allow={"missing": ["output.*"]})
    assert not reads
    # convert, which loads nothing, lets missing leaves through only by allow=
    with pytest.raises(cv.ConversionError, match=r"or allow it \(allow=\{'missing': \[\.\.\.\]"):
        cv.convert(first, safetensors.numpy.load_file(path), target=model)
    # a quantized model is planned apart (its kernels by their logical names or their
    # parts, either of which may be missing), with the same hint for a load
    with pytest.raises(
        cv.ConversionError,
        match=r"1 problem; nothing was converted\.\n  - 'output\.bias': no rule "
        r"produces this target leaf; add a Rule, or load with strict=False to keep the "
        r"model's value\.$",
    ):
        load_safetensors(tt.quantize(model, bits=8), path, rules=first)


def test_rules_transform_zero_size_tensors_alone_and_beside_others(tmp_path):
    # a step whose sources are all empty reads nothing into the scratch buffer (a regression:
    # it once made a memoryview of no buffer at all and raised a TypeError)
    path = tmp_path / "z.safetensors"
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    save_safetensors(path, {"empty": np.zeros((0, 3), np.float32), "a": a})
    rules = [cv.Rule("empty", "e", cv.transpose()), cv.Rule("a", "t", cv.transpose())]
    model = {"e": jax.ShapeDtypeStruct((3, 0), jnp.float32),
             "t": jax.ShapeDtypeStruct((3, 2), jnp.float32)}  # fmt: skip
    for order in (rules, rules[::-1]):  # the empty step first, then after a buffer exists
        loaded = load_safetensors(model, path, rules=order)
        assert loaded["e"].shape == (3, 0) and loaded["e"].dtype == jnp.float32
        assert np.array_equal(loaded["t"], a.T)


def test_a_transformed_tensor_goes_to_its_leaf_s_devices_not_the_default_one(tmp_path):
    tensors, path, rules = torch_mlp(tmp_path)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[4:8]), ("x",))  # without the default device
    target = tt.shard(abstract_mlp(), [("input.kernel", P(None, "x"))], mesh)
    loaded = load_safetensors(target, path, rules=rules)
    assert loaded.input.kernel.sharding == NamedSharding(mesh, P(None, "x"))
    assert np.array_equal(loaded.input.kernel, tensors["fc1.weight"].T)
    assert np.array_equal(loaded.output.kernel, tensors["fc2.weight"].T)


class Counted(cv.Transform):
    """`transform`, recording the count of arrays each call is asked to make."""

    def __init__(self, transform):
        self.transform, self.counts = transform, []

    def __call__(self, arrays, count=None):
        self.counts.append(count)
        return self.transform(arrays, count)


def test_transforms_are_told_how_many_arrays_to_make_as_convert_tells_them(tmp_path):
    rows = {f"l.{i}.w": np.full((4,), i, np.float32) for i in range(3)}
    fused = np.arange(8, dtype=np.float32)
    path = tmp_path / "parts.safetensors"
    save_safetensors(path, {**rows, "fused": fused})
    gather, split = Counted(cv.stack()), Counted(cv.split())
    rules = [cv.Rule("l.{i}.w", "w", gather), cv.Rule("fused", ["a", "b"], split)]
    target = {n: jax.ShapeDtypeStruct(s, jnp.float32) for n, s in [("w", (3, 4)), ("a", (4,)), ("b", (4,))]}  # fmt: skip
    loaded = load_safetensors(target, path, rules=rules)
    assert np.array_equal(loaded["w"], np.stack(list(rows.values())))
    assert np.array_equal(loaded["a"], fused[:4]) and np.array_equal(loaded["b"], fused[4:])
    # a gathering rule makes one array of all it reads: no count; a split, one per target
    assert gather.counts and set(gather.counts) == {None}
    assert split.counts and set(split.counts) == {2}


def test_transforming_steps_read_aligned_into_buffers_they_reuse(tmp_path, monkeypatch):
    import taktiny.loading._place as place

    parts = {f"{n}.{i}": np.arange(5 + 2 * i, dtype=np.float32) + k for k, n in enumerate("pqr")
             for i in range(3)}  # fmt: skip
    parts |= {"s.0": np.zeros(0, np.float32), "s.1": np.arange(4, dtype=np.float32)}  # no bytes
    path = tmp_path / "parts.safetensors"
    save_safetensors(path, parts)
    rules = [cv.Rule([f"{n}.0", f"{n}.1", f"{n}.2"], n, cv.concatenate()) for n in "pqr"]
    rules.append(cv.Rule(["s.0", "s.1"], "s", cv.concatenate()))
    target = {n: jax.ShapeDtypeStruct((21,), jnp.float32) for n in "pqr"}
    target["s"] = jax.ShapeDtypeStruct((4,), jnp.float32)
    reads, read = [], place.Scratch.read

    def logged(self, tensors, verify, perm=None):  # (steps run in several readers: by name)
        out = read(self, tensors, verify, perm)
        reads.append(
            (tensors[0].name, self, self.memory, [a.ctypes.data - self.start for a in out])
        )
        return out

    waited, block = [], jax.block_until_ready

    def blocking(tree):  # each step waits for its results before its buffer is read into again
        waited.append(sorted(tree) if isinstance(tree, dict) else tree)
        return block(tree)

    monkeypatch.setattr(place.Scratch, "read", logged)
    monkeypatch.setattr(jax, "block_until_ready", blocking)
    for verify in (True, False):
        reads.clear()
        waited.clear()
        loaded = load_safetensors(target, path, rules=rules, verify=verify)
        for n in "pqrs":
            own = [v for k, v in parts.items() if k.startswith(f"{n}.")]
            assert np.array_equal(loaded[n], np.concatenate(own)), n
        # each source at a multiple of 64 bytes (JAX adopts it uncopied); the third step
        # reads into the first one's buffer, as large as it needs: the same memory
        reads.sort(key=lambda read: read[0])
        assert [offsets for *_, offsets in reads[:3]] == [[0, 64, 128]] * 3
        assert reads[2][1] is reads[0][1] and reads[2][2] is reads[0][2]
        assert reads[1][1] is not reads[0][1]
        assert waited == [["p"], ["q"], ["r"], ["s"]]


class Eager:
    """A reader thread that reads each step the moment it is asked to: a schedule the real
    one may take (it starts at once, while the loop goes on), made certain."""

    def submit(self, fn, *args):
        future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as error:  # noqa: BLE001  (kept in the future, as a thread does)
            future.set_exception(error)
        return future


def test_with_one_buffer_a_step_is_read_into_it_only_once_the_step_before_is_placed(
    tmp_path, monkeypatch
):
    # a quantizing load keeps one read buffer: the reader may read the next step into it
    # only once the step before has been transformed and placed, however soon it reads
    import taktiny.loading._load as load_module

    monkeypatch.setattr(load_module, "reader_pool", Eager)  # (the pool: a call gives it)
    model = MLP(rngs=nn.Rngs(8))
    state = {k: v.astype(ml_dtypes.bfloat16) for k, v in flat_numpy(model).items()}
    floats = {k: v.astype(np.float32) for k, v in state.items()}
    state["input.bias"] = floats["input.bias"]  # loaded as it is, without the buffer
    path = tmp_path / "bf16.safetensors"
    save_safetensors(path, state)
    # in the file's order: input.bias as it is, then input.kernel, output.bias and
    # output.kernel cast (the kernels quantized) one after another through the one buffer
    assert list(open_safetensors(path)) == ["input.bias", "input.kernel", "output.bias",
                                            "output.kernel"]  # fmt: skip
    expected = tt.quantize(abstract_mlp().load_flat_state_dict(floats), bits=8)
    for verify in (True, False):
        loaded = load_safetensors(tt.quantize(abstract_mlp(), bits=8), path, verify=verify)
        assert_same(loaded, flat_numpy(expected))


def test_a_tensor_cast_on_loading_reaches_the_model_in_its_leaf_s_dtype(
    tmp_path, monkeypatch, reads
):
    # a tensor renamed into a leaf of another dtype is read whole into the read buffer and
    # cast as it streams in: the load never holds a second copy of the model in the
    # checkpoint's dtype (only a tensor of the leaf's own dtype is read device by device)
    import taktiny.loading._record as record_module  # (the load's name for state's)

    model = MLP(rngs=nn.Rngs(9))
    state = {k: v.astype(ml_dtypes.bfloat16) for k, v in flat_numpy(model).items()}
    path = tmp_path / "bf16.safetensors"
    save_safetensors(path, state)
    mesh = jax.make_mesh((2, 4), ("rows", "cols"))
    target = tt.shard(abstract_mlp(), [("input.kernel", P(None, "cols"))], mesh)
    given, load = [], record_module.load_resolved

    def spied(view, supplied):
        supplied = list(supplied)
        given.append({view.spec.names[i]: v.dtype for i, v in supplied})
        return load(view, supplied)

    monkeypatch.setattr(record_module, "load_resolved", spied)
    loaded = load_safetensors(target, path)
    assert_same(loaded, {k: v.astype(np.float32) for k, v in state.items()})
    assert loaded.input.kernel.sharding == NamedSharding(mesh, P(None, "cols"))
    assert given == [{k: np.dtype(np.float32) for k in state}]
    assert sorted(reads) == sorted((k, v.shape) for k, v in state.items())  # each whole, once


def test_a_rule_that_returns_its_source_gets_a_copy_not_the_reused_read_buffer(tmp_path):
    # cast to the dtype it has, transpose by the identity: the transform hands back the very
    # array it was given, which on CPU is the read buffer the next step reads into
    model = MLP(rngs=nn.Rngs(6))
    path = tmp_path / "mlp.safetensors"
    save_safetensors(path, model)
    rules = [cv.Rule("{layer}.kernel", "{layer}.kernel", cv.cast(jnp.float32)),
             cv.Rule("{layer}.bias", "{layer}.bias", cv.transpose((0,)))]  # fmt: skip
    loaded = load_safetensors(abstract_mlp(), path, rules=rules)
    assert_same(loaded, flat_numpy(model))


def test_split_rules_read_the_fused_tensor_once(tmp_path, reads):
    class QKV(nn.Module):
        def __init__(self, *, rngs):
            self.query = nn.Linear(4, 4, rngs=rngs)
            self.key = nn.Linear(4, 4, rngs=rngs)
            self.value = nn.Linear(4, 4, rngs=rngs)

    fused = np.arange(12 * 4, dtype=np.float32).reshape(12, 4)
    path = tmp_path / "qkv.safetensors"
    safetensors.numpy.save_file({"qkv.weight": fused, "qkv.bias": fused[:, 0].copy()}, str(path))
    rules = [
        cv.Rule("qkv.weight", ["query.kernel", "key.kernel", "value.kernel"],
                cv.chain(cv.split(0), cv.transpose())),
        cv.Rule("qkv.bias", ["query.bias", "key.bias", "value.bias"], cv.split(0)),
    ]  # fmt: skip
    loaded = load_safetensors(jax.eval_shape(lambda: QKV(rngs=nn.Rngs(0))), path, rules=rules)
    assert np.array_equal(loaded.key.kernel, fused[4:8].T)
    assert np.array_equal(loaded.value.bias, fused[8:, 0])
    assert sorted(reads) == [("qkv.bias", (12,)), ("qkv.weight", (12, 4))]


def test_a_sharded_checkpoint_loads_from_its_index_or_its_folder(tmp_path):
    model = MLP(rngs=nn.Rngs(2))
    files = save_safetensors(tmp_path / "model.safetensors", model, max_shard_size=4000)
    assert len(files) > 2  # shards and their index
    for path in (tmp_path / "model.safetensors.index.json", tmp_path):
        assert_same(load_safetensors(abstract_mlp(), path), flat_numpy(model))
    checkpoint = open_safetensors(tmp_path)
    assert len({t.file for t in checkpoint.values()}) == len(files) - 1
    assert checkpoint.nbytes == sum(np.asarray(v).nbytes for v in jax.tree.leaves(model))


def test_problems_are_found_from_the_headers_before_any_read(tmp_path, reads):
    path = tmp_path / "bad.safetensors"
    safetensors.numpy.save_file(
        {
            "input.kernel": np.zeros((32, 63), np.float32),
            "input.bias": np.zeros((64,), np.int32),
            "output.kernell": np.zeros((64, 4), np.float32),
        },
        str(path),
    )
    with pytest.raises(tt.StateDictError, match="load_safetensors") as caught:
        load_safetensors(abstract_mlp(), path)
    kinds = {p.name: p.kind for p in caught.value.problems}
    assert kinds == {
        "input.kernel": "shape",
        "input.bias": "dtype",
        "output.kernell": "unknown",
        "output.kernel": "missing",
        "output.bias": "missing",
    }
    assert "did you mean 'output.kernel'?" in str(caught.value)
    assert not reads


def test_partial_loads_keep_the_rest_but_an_abstract_model_cannot(tmp_path, reads):
    model = MLP(rngs=nn.Rngs(3))
    path = tmp_path / "input.safetensors"
    save_safetensors(path, {"input.kernel": model.input.kernel, "input.bias": model.input.bias})
    other = MLP(rngs=nn.Rngs(4))
    loaded = load_safetensors(other, path, strict=False)
    assert np.array_equal(loaded.input.kernel, model.input.kernel)
    assert np.array_equal(loaded.output.kernel, other.output.kernel)
    reads.clear()
    with pytest.raises(tt.StateDictError, match=r"'output\.kernel': not supplied, and the model"):
        load_safetensors(abstract_mlp(), path, strict=False)
    with pytest.raises(tt.StateDictError, match=r"'output\.bias': missing: strict=True"):
        load_safetensors(other, path)
    assert not reads


def test_values_cast_within_their_kind_and_overflow_is_refused(tmp_path):
    model = MLP(rngs=nn.Rngs(5))
    state = {k: np.asarray(v).astype(ml_dtypes.bfloat16) for k, v in flat_numpy(model).items()}
    path = tmp_path / "bf16.safetensors"
    save_safetensors(path, state)
    loaded = load_safetensors(abstract_mlp(), path)
    assert loaded.input.kernel.dtype == jnp.float32
    assert np.array_equal(loaded.input.kernel, state["input.kernel"].astype(np.float32))
    half = jax.eval_shape(lambda: MLP(rngs=nn.Rngs(0)))
    half = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float16), half)
    big = {k: np.full(np.shape(v), 1e6, np.float32) for k, v in flat_numpy(model).items()}
    save_safetensors(tmp_path / "big.safetensors", big)
    with pytest.raises(tt.StateDictError, match=r"casting float32 to float16 would turn"):
        load_safetensors(half, tmp_path / "big.safetensors")


def test_allow_needs_rules():
    with pytest.raises(ValueError, match="allow= applies to rules"):
        load_safetensors(abstract_mlp(), "unused.safetensors", allow={"missing": ["**"]})


def test_progress_bar_names_the_file_and_is_off_when_asked(saved, capsys, monkeypatch):
    _, path = saved
    load_safetensors(abstract_mlp(), path, progress=True)
    shown = capsys.readouterr().err
    assert "mlp.safetensors" in shown and "100%" in shown
    from tqdm import tqdm

    size = tqdm.format_sizeof(open_safetensors(path).nbytes, "", 1024)  # bytes, in KiB: "9.27k"
    assert f" {size}/{size} " in shown and "B/s]" in shown, (size, shown)
    load_safetensors(abstract_mlp(), path, progress=False)
    load_safetensors(abstract_mlp(), path)  # small: no bar by default
    assert capsys.readouterr().err == ""
    from taktiny.loading import _load

    total = open_safetensors(path).nbytes
    monkeypatch.setattr(_load, "PROGRESS_BYTES", total)  # a bar for more bytes than this
    load_safetensors(abstract_mlp(), path)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(_load, "PROGRESS_BYTES", total - 1)
    load_safetensors(abstract_mlp(), path)
    assert "mlp.safetensors" in capsys.readouterr().err


def test_without_tqdm_a_bar_asked_for_is_an_error_and_a_default_one_is_left_out(
    saved, capsys, monkeypatch
):
    import sys

    from taktiny.loading import _load

    model, path = saved
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # `from tqdm.auto import ...` fails
    with pytest.raises(
        ImportError,
        match=r"^taktiny\.io\.load_safetensors\(progress=True\) shows its bar with tqdm: pip "
        r"install 'taktiny\[safetensors\]' \(or tqdm\), or pass progress=False\.$",
    ):
        load_safetensors(abstract_mlp(), path, progress=True)
    monkeypatch.setattr(_load, "PROGRESS_BYTES", 0)  # every checkpoint is large
    assert_same(load_safetensors(abstract_mlp(), path), flat_numpy(model))
    assert capsys.readouterr().err == ""


def test_convert_of_an_opened_checkpoint_reads_tensor_by_tensor(saved, reads):
    model, path = saved
    rules = [cv.Rule("{layer}.kernel", "{layer}.kernel", cv.cast(jnp.bfloat16)),
             cv.Rule("{layer}.bias", "{layer}.bias")]  # fmt: skip
    converted = cv.convert(rules, open_safetensors(path), target=model)
    assert not reads and len(converted) == 4 and "input.kernel" in converted
    kernel = converted["input.kernel"]
    assert reads == [("input.kernel", (32, 64))]
    assert kernel.dtype == jnp.bfloat16
    assert np.array_equal(kernel, np.asarray(model.input.kernel).astype(ml_dtypes.bfloat16))
    loaded = model.load_flat_state_dict(converted, strict=True)
    assert loaded.output.kernel.dtype == jnp.float32  # cast back by the load, within its kind


def test_checkpoint_and_tensor_reprs(saved):
    _, path = saved
    checkpoint = open_safetensors(path)
    assert repr(checkpoint) == f"Checkpoint({str(path)!r}, 4 tensors, 9,488 bytes)"
    assert (
        repr(checkpoint["input.kernel"])
        == "Tensor('input.kernel', float32[32, 64], mlp.safetensors)"
    )
    assert checkpoint.metadata["format"] == "taktiny"


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_a_pytorch_file_given_to_load_safetensors_is_sent_to_read_torch(tmp_path, zipped):
    import torch

    path = tmp_path / "pytorch_model.bin"
    torch.save({"input.kernel": torch.ones(2)}, path, _use_new_zipfile_serialization=zipped)
    kind = (
        "a zip archive, as torch.save writes" if zipped else "a pickle, torch.save's legacy format"
    )
    message = (
        f"{path}: not a safetensors file but, by its first bytes, a PyTorch file ({kind}): "
        f"read it with taktiny.io.read_torch(path), which loads its tensors without running "
        f"code, and load the result with load_state_dict or taktiny.convert."
    )
    for load in (lambda: load_safetensors(abstract_mlp(), path), lambda: open_safetensors(path)):
        with pytest.raises(SafetensorsError) as error:
            load()
        assert str(error.value) == message
    assert read_torch(path)["input.kernel"].tolist() == [1.0, 1.0]  # as the message says


def test_an_empty_tensor_is_placed_on_its_leafs_devices_without_the_default_one(tmp_path):
    path = tmp_path / "e.safetensors"
    save_safetensors(
        path, {"empty": np.zeros((0, 4), np.float32), "w": np.ones((2, 4), np.float32)}
    )
    mesh = jax.sharding.Mesh(np.array(jax.devices()[4:8]), ("cols",))  # not device 0
    sharding = NamedSharding(mesh, P(None, "cols"))
    tree = {n: jax.ShapeDtypeStruct(s, np.float32, sharding=sharding)
            for n, s in (("empty", (0, 4)), ("w", (2, 4)))}  # fmt: skip
    got = load_safetensors(tree, path)
    assert got["empty"].shape == (0, 4) and got["empty"].sharding == sharding
    assert got["w"].sharding == sharding and np.array_equal(got["w"], np.ones((2, 4)))


def test_python_number_leaves_are_loaded(tmp_path):
    path = tmp_path / "s.safetensors"
    save_safetensors(path, {"x": np.array(2.5, np.float32), "n": np.array(7, np.int64)})
    got = load_safetensors({"x": 1.0, "n": 3}, path)
    assert float(got["x"]) == 2.5 and int(got["n"]) == 7
    assert got["x"].shape == got["n"].shape == ()


def test_wrong_shapes_kinds_and_names_are_each_told_exactly(tmp_path):
    path = tmp_path / "bad.safetensors"
    state = {"w": np.zeros((3, 4), np.float32), "n": np.zeros(2, np.float32)}
    state.update({"f": np.zeros(2, np.int32), "g": np.ones(1, np.float32)})
    save_safetensors(path, state)
    model = {"w": ((4, 4), jnp.float32), "n": ((2,), jnp.int32), "f": ((2,), jnp.float32)}
    model = {n: jax.ShapeDtypeStruct(*spec) for n, spec in model.items()}
    model["g"] = {"a": jax.ShapeDtypeStruct((1,), jnp.float32)}
    with pytest.raises(tt.StateDictError) as caught:
        load_safetensors(model, path)
    got = {p.name: (p.kind, p.expected, p.got, p.hint) for p in caught.value.problems}
    assert got["w"] == ("shape", (4, 4), (3, 4), "shape mismatch: expected (4, 4), got (3, 4).")
    cast = "Loads only cast within a kind; convert the value yourself if this is really intended."
    assert got["n"] == (
        "dtype", "int32", "float32",
        f"dtype kind changes: the model holds int32 (signed integer), got float32 (floating). {cast}",
    )  # fmt: skip
    assert got["f"][1:] == (
        "float32", "int32",
        f"dtype kind changes: the model holds float32 (floating), got int32 (signed integer). {cast}",
    )  # fmt: skip
    assert "by name (e.g. 'g.a')" in got["g"][3]  # a group of the model's: its leaves by name


def test_a_tree_of_numpy_arrays_loads_onto_the_default_device(tmp_path):
    path = tmp_path / "n.safetensors"
    save_safetensors(path, {"w": np.arange(4, dtype=np.float32)})
    loaded = load_safetensors({"w": np.zeros(4, np.float32)}, path)  # leaves without .sharding
    assert isinstance(loaded["w"], jax.Array) and loaded["w"].devices() == {jax.devices()[0]}
    assert np.array_equal(loaded["w"], np.arange(4, dtype=np.float32))


@pytest.mark.parametrize("staged", [False, True], ids=["adopted", "staged"])
def test_leaves_without_a_sharding_load_onto_the_callers_default_device(
    tmp_path, monkeypatch, staged
):
    # `jax.default_device` is the calling thread's: the reader threads place as it says
    # (placed, or staged for devices that copy, a TPU's; simulated on the CPU), each way
    if staged:
        import taktiny.loading._ways as ways_module

        monkeypatch.setattr(ways_module, "_staging", lambda sharding: True)
    path = tmp_path / "n.safetensors"
    state = {"w": np.arange(4, dtype=np.float32), "t": np.ones((3, 2), np.float32)}
    save_safetensors(path, state)
    rules = [cv.Rule("w", "w"), cv.Rule("t", "t", cv.transpose())]
    target = {"w": jax.ShapeDtypeStruct((4,), np.float32), "t": np.zeros((3, 2), np.float32)}
    turned = {**target, "t": np.zeros((2, 3), np.float32)}  # (numpy leaves: no sharding)
    there = jax.devices()[5]
    with jax.default_device(there):
        plain, ruled = load_safetensors(target, path), load_safetensors(turned, path, rules=rules)
    for loaded in (plain, ruled):
        assert {n: v.devices() for n, v in loaded.items()} == {"w": {there}, "t": {there}}
        assert np.array_equal(loaded["w"], state["w"])
    assert np.array_equal(plain["t"], state["t"]) and np.array_equal(ruled["t"], state["t"].T)


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mapped"])
def test_a_file_cut_after_it_was_opened_is_named_by_the_load_that_reads_it(
    tmp_path, monkeypatch, mapped
):
    if mapped:  # (onto devices that copy host memory, a TPU's; simulated on the CPU)
        import taktiny.loading._ways as ways_module

        monkeypatch.setattr(ways_module, "_staging", lambda sharding: True)
    path = tmp_path / "cut.safetensors"
    save_safetensors(path, {"w": np.arange(64, dtype=np.float32)})
    checkpoint = open_safetensors(path)
    os.truncate(path, path.stat().st_size - 30)
    with pytest.raises(
        SafetensorsError,
        match=rf"^{path}: the file ends inside the bytes of 'w'; it was truncated after it "
        r"was opened\. Write it again\.$",
    ):
        load_safetensors({"w": jax.ShapeDtypeStruct((64,), jnp.float32)}, checkpoint, verify=False)


# Without x64 JAX holds int64 as int32 and float64 as float32, and jax.device_put narrows
# what it is given without a word: a file's 64-bit values are checked first. (The leaves
# are made JAX arrays in the test: one made at import would start JAX's backend in the
# server `make mutate` forks.)
WIDE = [
    ("int64 past int32", np.array([2**40 + 5], np.int64), np.zeros(1, np.int32),
     r"'n': narrowing int64 to int32 would change values; convert the value yourself\."),
    ("int64 past int32, into a Python int", np.array(2**40 + 5, np.int64), 0,
     r"'n': narrowing int64 to int32 would change values"),
    ("uint64 past uint32", np.array([2**32], np.uint64), np.zeros(1, np.uint32),
     r"'n': narrowing uint64 to uint32 would change values"),
    ("float64 past float32", np.array([1.0, 1e300], np.float64), np.zeros(2, np.float32),
     r"'n': casting float64 to float32 would turn a value into inf: the largest is 1e\+300"),
]  # fmt: skip


@pytest.mark.parametrize("abstract", [False, True], ids=["concrete", "abstract"])
@pytest.mark.parametrize(
    ("saved", "leaf", "message"), [w[1:] for w in WIDE], ids=[w[0] for w in WIDE]
)
def test_64_bit_values_that_jax_holds_narrower_are_refused_not_wrapped(
    tmp_path, saved, leaf, message, abstract
):
    path = tmp_path / "wide.safetensors"
    save_safetensors(path, {"n": saved})
    target = {"n": jnp.asarray(leaf) if isinstance(leaf, np.ndarray) else leaf}
    target = jax.eval_shape(lambda: target) if abstract else target
    head = r"^taktiny\.io\.load_safetensors\(dict\): 1 problem; nothing was loaded\.\n  - "
    with pytest.raises(tt.StateDictError, match=head + message):
        load_safetensors(target, path, progress=False)


def test_64_bit_values_that_fit_load_into_what_jax_holds_them_in(tmp_path):
    path = tmp_path / "wide.safetensors"
    ints, floats = np.array([-(2**31), 2**31 - 1], np.int64), np.array([1e30, 0.1], np.float64)
    save_safetensors(path, {"i": ints, "f": floats, "s": np.array(7, np.int64)})
    target = {"i": jnp.zeros(2, jnp.int32), "f": jnp.zeros(2, jnp.float32), "s": 0}
    loaded = load_safetensors(target, path, progress=False)
    assert loaded["i"].dtype == jnp.int32 and loaded["i"].tolist() == ints.tolist()
    assert loaded["f"].dtype == jnp.float32
    assert np.array_equal(loaded["f"], floats.astype(np.float32))
    assert loaded["s"].dtype == jnp.int32 and int(loaded["s"]) == 7


def test_a_flat_dict_loads_back_as_a_flat_dict_of_its_own_keys(tmp_path):
    """What save_safetensors saves of a flat {name: array} dict (part of a model, under its
    flat names) loads back into a flat dict: concrete, abstract or sharded, in its own
    order, each value cast to its target's dtype; the model then takes it as it is."""
    model = MLP(rngs=nn.Rngs(1))
    part = {k: v for k, v in tt.flat_state_dict(model).items() if k.startswith("output.")}
    path = tmp_path / "part.safetensors"
    save_safetensors(path, part)
    target = {"output.kernel": jnp.zeros((64, 4), jnp.bfloat16), "output.bias": jnp.zeros(4)}
    mesh = jax.make_mesh((8,), ("model",))
    sharded = {
        "output.kernel": jax.ShapeDtypeStruct((64, 4), jnp.float32, sharding=NamedSharding(mesh, P("model"))),
        "output.bias": jax.ShapeDtypeStruct((4,), jnp.float32),
    }  # fmt: skip
    for into in (target, jax.eval_shape(lambda: target), sharded):
        loaded = load_safetensors(into, path, progress=False)
        assert list(loaded) == list(into)  # the target's keys, in its order
        for name, value in loaded.items():
            assert value.dtype == into[name].dtype, name
            expected = np.asarray(part[name]).astype(into[name].dtype)
            assert np.asarray(value).tobytes() == expected.tobytes(), name
    assert loaded["output.kernel"].sharding == sharded["output.kernel"].sharding
    assert target["output.kernel"].sum() == 0  # the target is left as it was
    back = MLP(rngs=nn.Rngs(2)).load_flat_state_dict(load_safetensors(part, path, progress=False))
    assert_same(back.output, flat_numpy(model.output))
    plan = tt.io.plan_load(jax.eval_shape(lambda: target), path)
    assert plan.error is None and sorted(t for s in plan.steps for t in s.targets) == sorted(part)


def test_a_flat_dict_target_is_checked_as_any_target_is(tmp_path):
    path = tmp_path / "part.safetensors"
    save_safetensors(path, {"a.b": np.ones((2, 3), np.float32), "a.c": np.ones(3, np.int32)})
    missing = r"(?s)^taktiny\.io\.load_safetensors\(dict\): 2 problems.*'a\.c': unknown key; did you mean 'a\.d'\?.*'a\.d': missing"
    with pytest.raises(tt.StateDictError, match=missing):
        load_safetensors({"a.b": jnp.zeros((2, 3)), "a.d": jnp.zeros(3, jnp.int32)}, path)
    with pytest.raises(tt.StateDictError, match=r"(?s)'a\.b'.*expected \(3, 2\).*\(2, 3\)"):
        load_safetensors({"a.b": jnp.zeros((3, 2)), "a.c": jnp.zeros(3, jnp.int32)}, path)
    with pytest.raises(
        TypeError,
        match=r"^taktiny\.io\.load_safetensors\(dict\): the flat target names both 'a' and "
        r"'a\.b'; a load names a tree's leaves by their paths, and no path ends at a leaf and "
        r"goes on\. Read such a checkpoint without a target: \{n: np\.asarray\(t\) for n, t in "
        r"open_safetensors\(path\)\.items\(\)\}\.$",
    ):
        load_safetensors({"a": jnp.zeros(1), "a.b": jnp.zeros((2, 3))}, path)
    with pytest.raises(TypeError, match=r"names both 'a\.b' and 'a\.b\.c'"):
        load_safetensors({"a.b": jnp.zeros((2, 3)), "a.b.c": jnp.zeros(1)}, path)


def test_rules_with_a_double_star_rename_every_depth_tensor_by_tensor(tmp_path, reads):
    """`model.**.weight` -> `**.kernel` (transposed) and `model.**.bias` -> `**.bias` load
    a torch-named checkpoint of nested layers at every depth, each tensor read once."""
    model = MLP(rngs=nn.Rngs(1))
    theirs = {}
    for name, value in tt.flat_state_dict(model).items():
        torch_name = "model." + name.replace("kernel", "weight")
        theirs[torch_name] = np.asarray(value).T if name.endswith("kernel") else np.asarray(value)
    path = tmp_path / "torch-names.safetensors"
    save_safetensors(path, theirs)
    rules = [cv.Rule("model.**.weight", "**.kernel", cv.transpose()),
             cv.Rule("model.**.bias", "**.bias")]  # fmt: skip
    reads.clear()
    loaded = load_safetensors(jax.eval_shape(lambda: model), path, rules=rules, progress=False)
    assert_same(loaded, flat_numpy(model))
    assert sorted(name for name, _ in reads) == sorted(theirs)


def test_a_custom_parameter_stored_as_one_tensor_is_a_structure_problem(tmp_path):
    """A custom PyTree parameter (not a quantized one) that the checkpoint holds whole, as
    one tensor under its name, is told as a value of another structure, not read into it
    nor crashed on; its parts are not told missing besides."""
    model = {"w": Scaled(jnp.zeros(3, jnp.int8), jnp.ones(1)), "b": jnp.zeros(2)}
    path = tmp_path / "m.safetensors"
    save_safetensors(path, {"w": np.zeros(3, np.float32), "b": np.ones(2, np.float32)})
    with pytest.raises(tt.StateDictError, match="1 problem") as caught:
        load_safetensors(model, path)
    [problem] = caught.value.problems
    assert (problem.kind, problem.name) == ("structure", "w")
    assert problem.hint.startswith("expected a value structured as PyTreeDef(CustomNode(Scaled")
