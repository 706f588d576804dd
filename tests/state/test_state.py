"""The four state methods, partial loads, conversions and every kind of StateDictError."""

import dataclasses
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import MLP
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import taktiny as tt
from taktiny import nn
from taktiny.state import _state


@pytest.fixture(autouse=True, params=["walk", "flat"])
def view(request, monkeypatch):
    """Every test here runs twice: loads that walk to the leaves they name, and loads that
    flatten the whole tree (the two views must find the same results and problems)."""
    monkeypatch.setattr(_state, "WALK_LIMIT", 10**9 if request.param == "walk" else -1)
    return request.param


class Stack(nn.Module):
    def __init__(self, n, *, rngs):
        self.layers = [nn.Linear(4, 4, rngs=rngs) for _ in range(n)]
        self.head = {"score": nn.Linear(4, 1, use_bias=False, rngs=rngs)}
        self.steps = jnp.zeros((), jnp.int32)
        self.depth = n


def leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(la, lb, strict=True)
    )


def test_state_dict_mirrors_the_module_tree_and_holds_the_same_arrays():
    m = MLP(rngs=nn.Rngs(0))
    state = m.state_dict()
    assert list(state) == ["input", "output"]
    assert list(state["input"]) == ["kernel", "bias"]
    assert state["input"]["kernel"] is m.input.kernel
    assert state["output"]["bias"] is m.output.bias


def test_flat_state_dict_is_in_module_order_not_string_order():
    m = Stack(12, rngs=nn.Rngs(0))
    names = list(m.flat_state_dict())
    expected = [f"layers.{i}.{p}" for i in range(12) for p in ("kernel", "bias")]
    assert names == [*expected, "head.score.kernel", "steps"]
    assert list(m.state_dict()["layers"]) == [str(i) for i in range(12)]
    assert m.flat_state_dict()["layers.10.bias"] is m.layers[10].bias


def test_no_bias_means_no_bias_in_the_state():
    lin = nn.Linear(3, 2, use_bias=False, rngs=nn.Rngs(0))
    assert lin.state_dict().keys() == {"kernel"}
    assert lin.bias is None


def test_round_trip_returns_a_new_equal_module():
    m = Stack(3, rngs=nn.Rngs(0))
    for loaded in (m.load_state_dict(m.state_dict()), m.load_flat_state_dict(m.flat_state_dict())):
        assert loaded is not m and type(loaded) is type(m)
        assert jax.tree.structure(loaded) == jax.tree.structure(m)
        assert leaves_equal(loaded, m)


def test_partial_load_changes_exactly_the_supplied_leaves():
    m = Stack(3, rngs=nn.Rngs(0))
    donor = Stack(3, rngs=nn.Rngs(1))
    new = m.load_state_dict({"layers": {"1": donor.state_dict()["layers"]["1"]}})
    assert new.layers[1].kernel is donor.layers[1].kernel
    assert new.layers[1].bias is donor.layers[1].bias
    assert new.layers[0].kernel is m.layers[0].kernel and new.layers[2].bias is m.layers[2].bias
    assert new.head["score"].kernel is m.head["score"].kernel
    flat = m.load_flat_state_dict({"layers.2.kernel": donor.layers[2].kernel})
    assert flat.layers[2].kernel is donor.layers[2].kernel
    assert flat.layers[2].bias is m.layers[2].bias
    # the input module is never changed
    assert m.layers[1].kernel is not donor.layers[1].kernel


def test_guide_partial_encoder_example():
    class Classifier(nn.Module):
        def __init__(self, num_classes, *, rngs):
            self.encoder = MLP(rngs=rngs)
            self.head = nn.Linear(4, num_classes, rngs=rngs)

    pretrained = Classifier(3, rngs=nn.Rngs(1)).state_dict()
    model = Classifier(num_classes=10, rngs=nn.Rngs(0))
    fresh = model.head.kernel
    model = model.load_state_dict({"encoder": pretrained["encoder"]})
    assert model.encoder.input.kernel is pretrained["encoder"]["input"]["kernel"]
    assert model.head.kernel is fresh


def test_inputs_may_be_numpy_lists_and_other_array_likes():
    lin = nn.Linear(2, 2, rngs=nn.Rngs(0))
    new = lin.load_state_dict({"kernel": np.eye(2, dtype=np.float64), "bias": [1.0, 2.0]})
    assert isinstance(new.kernel, jax.Array) and new.kernel.dtype == jnp.float32
    assert isinstance(new.bias, jax.Array) and new.bias.dtype == jnp.float32
    np.testing.assert_array_equal(new.bias, [1.0, 2.0])
    steps = Stack(1, rngs=nn.Rngs(0)).load_flat_state_dict({"steps": 7})
    assert steps.steps.dtype == jnp.int32 and int(steps.steps) == 7


def test_float_casts_follow_the_model_dtype():
    lin = nn.Linear(2, 2, param_dtype=jnp.bfloat16, rngs=nn.Rngs(0))
    new = lin.load_state_dict({"kernel": jnp.ones((2, 2), jnp.float32)})
    assert new.kernel.dtype == jnp.bfloat16
    back = nn.Linear(2, 2, rngs=nn.Rngs(0)).load_state_dict({"bias": jnp.ones(2, jnp.bfloat16)})
    assert back.bias.dtype == jnp.float32


def test_results_keep_the_placement_of_the_leaves_they_replace():
    mesh = jax.make_mesh((2, 4), ("x", "y"), devices=jax.devices("cpu"))
    sharding = NamedSharding(mesh, PartitionSpec("x", "y"))
    lin = nn.Linear(4, 8, rngs=nn.Rngs(0))
    lin = lin.replace(kernel=jax.device_put(lin.kernel, sharding))
    new = lin.load_state_dict({"kernel": np.ones((4, 8), np.float32), "bias": jnp.ones(8)})
    assert new.kernel.sharding == sharding
    assert new.bias.sharding == lin.bias.sharding
    on_other = jax.device_put(jnp.ones(8), jax.devices("cpu")[5])
    assert lin.load_state_dict({"bias": on_other}).bias.sharding == lin.bias.sharding


def test_loading_inside_jit_matches_outside():
    m, donor = MLP(rngs=nn.Rngs(0)), MLP(rngs=nn.Rngs(1))
    state = donor.state_dict()
    inside = jax.jit(lambda m, s: m.load_state_dict(s))(m, state)
    assert leaves_equal(inside, m.load_state_dict(state))
    x = jnp.ones((2, 32))
    out = jax.jit(lambda m, s, x: m.load_flat_state_dict(s)(x))(m, donor.flat_state_dict(), x)
    np.testing.assert_allclose(out, donor(x), rtol=1e-6)


def test_abstract_model_is_a_restore_target_and_loads_fully():
    abstract = jax.eval_shape(lambda: MLP(rngs=nn.Rngs(0)))
    target = abstract.state_dict()
    assert isinstance(target["input"]["kernel"], jax.ShapeDtypeStruct)
    concrete = MLP(rngs=nn.Rngs(3)).state_dict()
    model = abstract.load_state_dict(concrete)
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(model))
    np.testing.assert_array_equal(model.output.bias, concrete["output"]["bias"])


def test_partial_load_into_abstract_model_names_the_unfilled_leaves():
    abstract = jax.eval_shape(lambda: MLP(rngs=nn.Rngs(0)))
    state = MLP(rngs=nn.Rngs(3)).state_dict()
    with pytest.raises(
        tt.StateDictError, match=r"'output\.kernel': not supplied, and the model is abstract"
    ) as info:
        abstract.load_state_dict({"input": state["input"]})
    assert info.value.missing_keys == ("output.kernel", "output.bias")


# --- errors: one type, every offending name, nothing half-applied ---------------------------


def error_of(fn):
    with pytest.raises(tt.StateDictError) as info:
        fn()
    assert isinstance(info.value, ValueError)
    return info.value


def test_unknown_key_suggests_the_closest_name():
    m = MLP(rngs=nn.Rngs(0))
    with pytest.raises(
        tt.StateDictError, match=r"'input\.kernal': unknown key; did you mean 'input\.kernel'\?"
    ):
        m.load_flat_state_dict({"input.kernal": np.zeros((32, 64))})
    with pytest.raises(tt.StateDictError, match=r"'inptu': unknown key; did you mean 'input'\?"):
        m.load_state_dict({"inptu": {"kernel": np.zeros((32, 64))}})
    err = error_of(lambda: m.load_flat_state_dict({"zzz": 1, "yyy": 2}))
    assert err.unexpected_keys == ("zzz", "yyy")


def test_missing_keys_under_strict():
    m = MLP(rngs=nn.Rngs(0))
    state = m.state_dict()
    del state["output"]
    with pytest.raises(tt.StateDictError, match=r"'output\.kernel': missing: strict=True"):
        m.load_state_dict(state, strict=True)
    err = error_of(lambda: m.load_state_dict(state, strict=True))
    assert err.missing_keys == ("output.kernel", "output.bias")
    assert m.load_state_dict(state).output.kernel is m.output.kernel  # fine when not strict


def test_shape_mismatch_shows_expected_and_got():
    m = MLP(rngs=nn.Rngs(0))
    with pytest.raises(
        tt.StateDictError, match=r"'output\.bias': shape mismatch: expected \(4,\), got \(5,\)"
    ):
        m.load_flat_state_dict({"output.bias": np.zeros(5, np.float32)})
    with pytest.raises(tt.StateDictError, match=r"expected \(32, 64\), got \(64, 32\)"):
        m.load_state_dict({"input": {"kernel": jnp.zeros((64, 32))}})


def test_dtype_kind_change_is_an_error():
    m = MLP(rngs=nn.Rngs(0))
    with pytest.raises(
        tt.StateDictError,
        match=r"'input\.bias': dtype kind changes: the model holds float32 \(floating\), got int8",
    ):
        m.load_flat_state_dict({"input.bias": np.zeros(64, np.int8)})
    s = Stack(1, rngs=nn.Rngs(0))
    with pytest.raises(
        tt.StateDictError,
        match=r"'steps': dtype kind changes.*int32 \(signed integer\), got float32",
    ):
        s.load_flat_state_dict({"steps": jnp.zeros((), jnp.float32)})
    with pytest.raises(
        tt.StateDictError, match=r"'steps': narrowing int64 to int32 would change values"
    ):
        s.load_flat_state_dict({"steps": np.array(2**40)})


def test_narrowing_integer_cast_inside_jit_is_an_error():
    s = Stack(1, rngs=nn.Rngs(0)).replace(steps=jnp.zeros((), jnp.int8))
    with pytest.raises(
        tt.StateDictError, match=r"'steps': narrowing int32 to int8 cannot be checked inside jit"
    ):
        jax.jit(lambda m, v: m.load_flat_state_dict({"steps": v}))(s, jnp.array(3, jnp.int32))
    assert int(s.load_flat_state_dict({"steps": jnp.array(3, jnp.int32)}).steps) == 3


def test_python_scalar_leaves_forced_to_be_data_load_as_arrays():
    class Counter(nn.Module):
        count: int = nn.field(static=False)

    c = Counter(count=3)
    assert list(c.state_dict()) == ["count"] and int(c.state_dict()["count"]) == 3
    loaded = c.load_state_dict({"count": np.int32(5)})
    assert isinstance(loaded.count, jax.Array) and int(loaded.count) == 5
    with pytest.raises(
        tt.StateDictError, match=r"'count': shape mismatch: expected \(\), got \(2,\)"
    ):
        c.load_state_dict({"count": [1, 2]})


def test_non_array_values_are_errors():
    m = MLP(rngs=nn.Rngs(0))
    with pytest.raises(
        tt.StateDictError,
        match=r"'input\.bias': expected an array, got a value that is not numeric \('oops'\)",
    ):
        m.load_flat_state_dict({"input.bias": "oops"})
    with pytest.raises(
        tt.StateDictError, match=r"'input\.bias': expected an array, got a value of type NoneType"
    ):
        m.load_flat_state_dict({"input.bias": None})
    abstract = jax.eval_shape(lambda: MLP(rngs=nn.Rngs(0)))
    with pytest.raises(
        tt.StateDictError, match=r"an abstract array float32\[32, 64\] \(from jax\.eval_shape\)"
    ):
        m.load_state_dict(abstract.state_dict())


def test_dict_where_array_belongs_and_the_reverse():
    m = MLP(rngs=nn.Rngs(0))
    with pytest.raises(
        tt.StateDictError, match=r"'input\.kernel': expected an array, got a dict with keys \['a'\]"
    ):
        m.load_state_dict({"input": {"kernel": {"a": 1}}})
    with pytest.raises(
        tt.StateDictError,
        match=r"'input': expected a dict of this submodule's parameters \(keys \['kernel', 'bias'\]\), got an array float32\[3\]",
    ):
        m.load_state_dict({"input": jnp.zeros(3)})
    with pytest.raises(
        tt.StateDictError,
        match=r"'input': names a group of parameters \(input\.kernel, input\.bias\)",
    ):
        m.load_flat_state_dict({"input": jnp.zeros(3)})
    with pytest.raises(
        tt.StateDictError, match=r"'input\.kernel' is an array, so it has no entry 'value'"
    ):
        m.load_flat_state_dict({"input.kernel.value": jnp.zeros(3)})
    with pytest.raises(tt.StateDictError, match=r"'input\.kernel': expected an array, got a dict"):
        m.load_flat_state_dict({"input.kernel": {"value": 1}})


def test_key_with_a_dot_in_a_nested_state():
    m = MLP(rngs=nn.Rngs(0))
    with pytest.raises(
        tt.StateDictError,
        match=r"'input\.kernel': nested state keys must not contain '\.'.*load_flat_state_dict",
    ):
        m.load_state_dict({"input.kernel": jnp.zeros((32, 64))})


def test_all_problems_are_reported_at_once_and_nothing_is_applied():
    m = MLP(rngs=nn.Rngs(0))
    before = m.input.kernel
    good = jnp.ones((32, 64))
    err = error_of(
        lambda: m.load_flat_state_dict(
            {"input.kernel": good, "output.bias": np.zeros(9), "extra": 1, "input.bias": "x"}
        )
    )
    # structural problems come first, then problems with values, then missing names
    assert [p.kind for p in err.problems] == ["unknown", "shape", "value"]
    assert [p.name for p in err.problems] == ["extra", "output.bias", "input.bias"]
    assert str(err).startswith("MLP.load_flat_state_dict(): 3 problems; nothing was loaded.")
    assert err.problems[1].expected == (4,) and err.problems[1].got == (9,)
    assert m.input.kernel is before


def test_non_dict_state_is_a_type_error():
    # _state.load is called directly: in tests beartype would reject the method call first
    # (test_bad_arguments_read_the_same_without_the_test_time_type_checks calls the methods)
    m = MLP(rngs=nn.Rngs(0))
    for flat in (False, True):
        method = "load_flat_state_dict" if flat else "load_state_dict"
        with pytest.raises(TypeError, match=rf"MLP\.{method}\(\) expects a dict, got MLP"):
            _state.load(m, m, strict=False, flat=flat)


def _aligned(values):
    """A float32 copy of `values` in a 64-byte-aligned buffer: the kind jax.device_put
    shares on CPU instead of copying."""
    values = np.asarray(values, np.float32)
    buffer = np.empty(values.nbytes + 64, np.uint8)
    start = -buffer.ctypes.data % 64
    array = buffer[start : start + values.nbytes].view(np.float32).reshape(values.shape)
    array[...] = values
    return array


class _Tensor:
    """Stands in for a torch tensor: np.asarray() of it is a view of its memory."""

    def __init__(self, array):
        self.array = array

    def __array__(self, dtype=None, copy=None):
        return self.array


def test_loads_do_not_share_memory_with_the_callers_arrays():
    """Regression: loads of aligned NumPy arrays (or of objects that expose their memory,
    like torch tensors) used to share it on CPU, so updating the source afterwards (a
    torch BatchNorm's running statistics, a reused buffer) silently changed the model."""
    m = MLP(rngs=nn.Rngs(0))
    abstract = jax.eval_shape(lambda: nn.Linear(2, 3, rngs=nn.Rngs(0)))
    sources = {name: _aligned(np.ones(v.shape)) for name, v in m.flat_state_dict().items()}
    kernel, bias = _aligned(np.ones((2, 3))), _aligned(np.ones(3))
    loaded = [
        m.load_flat_state_dict(sources),
        m.load_state_dict({"input": {"kernel": sources["input.kernel"]}}),
        abstract.load_flat_state_dict({"kernel": kernel, "bias": _Tensor(bias)}, strict=True),
    ]
    for array in [*sources.values(), kernel, bias]:
        array[...] = 7.0
    for model in loaded:
        for leaf in jax.tree.leaves(model):
            assert not np.any(np.asarray(leaf) == 7.0)


def _owning_aligned(n):
    """n float32 ones in a NumPy array that owns its memory at a 64-byte-aligned address (the
    kind jax.device_put shares on CPU); NumPy's allocator gives one within a few tries."""
    tries = []
    while len(tries) < 100:
        array = np.ones(n, np.float32)
        if array.flags.owndata and array.ctypes.data % 64 == 0:
            return array
        tries.append(array)  # kept alive, so that the next try gets a new address
    raise AssertionError("NumPy gave no 64-byte-aligned buffer in 100 tries")


@pytest.mark.parametrize("strict", [False, True])
def test_loads_do_not_share_memory_with_arrays_the_caller_owns(strict):
    """The same for a NumPy array that owns its memory: the caller may write to it after the
    load without changing the model."""
    m = One(jnp.zeros(4096))  # (defined below)
    source = _owning_aligned(4096)
    loaded = m.load_state_dict({"w": source}, strict=strict)
    source[...] = 7.0
    np.testing.assert_array_equal(loaded.w, np.ones(4096, np.float32))


def test_full_states_are_checked_like_partial_ones():
    # a state naming every leaf takes a faster path; it must find the same problems
    m = MLP(rngs=nn.Rngs(0))
    state = m.state_dict()
    state["output"]["bias"] = np.zeros(5, np.float32)
    with pytest.raises(
        tt.StateDictError, match=r"'output\.bias': shape mismatch: expected \(4,\), got \(5,\)"
    ):
        m.load_state_dict(state)
    state["output"]["bias"] = {"nested": 1}
    with pytest.raises(
        tt.StateDictError,
        match=r"'output\.bias': expected an array, got a dict with keys \['nested'\]",
    ):
        m.load_state_dict(state)
    state["output"]["bias"] = np.zeros(4, np.float32)
    state["output"]["extra"] = np.zeros(4, np.float32)
    with pytest.raises(tt.StateDictError, match=r"'output\.extra': unknown key"):
        m.load_state_dict(state)
    flat = m.flat_state_dict()
    flat["input.bias"] = np.zeros(64, np.int32)
    with pytest.raises(tt.StateDictError, match=r"'input\.bias': dtype kind changes"):
        m.load_flat_state_dict(flat)
    state = m.state_dict()
    state["input"] = jnp.zeros(3)
    with pytest.raises(
        tt.StateDictError, match=r"'input': expected a dict of this submodule's parameters"
    ):
        m.load_state_dict(state)


def test_python_scalars_forced_into_the_data_load_like_arrays():
    # Regression (found by property_tests): a field forced into the data with
    # field(static=False) holds a Python scalar, which the state lists like any leaf; loading
    # the module's own state crashed with AttributeError ('int' object has no attribute 'shape').
    class Counter(nn.Module):
        count: int = nn.field(static=False)
        rate: float = nn.field(static=False)

    m = Counter(count=3, rate=0.5)
    assert {k: v.item() for k, v in m.flat_state_dict().items()} == {"count": 3, "rate": 0.5}
    loaded = m.load_flat_state_dict(m.flat_state_dict(), strict=True)
    # a loaded leaf is a JAX array of the dtype JAX gives the scalar, as under jax.jit
    assert isinstance(loaded.count, jax.Array) and loaded.count.dtype == jnp.int32
    assert int(loaded.count) == 3 and loaded.rate.dtype == jnp.float32
    assert int(m.load_state_dict({"count": np.int64(7)}).count) == 7
    with pytest.raises(
        tt.StateDictError, match=r"'count': shape mismatch: expected \(\), got \(2,\)"
    ):
        m.load_flat_state_dict({"count": np.zeros(2, np.int32)})
    with pytest.raises(
        tt.StateDictError,
        match=r"'rate': dtype kind changes: the model holds float32 \(floating\), got int8",
    ):
        m.load_state_dict({"rate": np.int8(1)})


def test_non_string_keys_in_a_nested_state_are_named_as_such():
    # Regression (found by property_tests): an int key where the module has "0" was reported as
    # "names a group of parameters ... got a dict" (and left out of unexpected_keys), or, where
    # "0" is an array, as "unknown key; did you mean 'w.0'?", the very name that was given.
    m = Stack(2, rngs=nn.Rngs(0))
    layer = m.state_dict()["layers"]["0"]
    with pytest.raises(
        tt.StateDictError,
        match=r"'layers\.0': nested state keys must be strings, got int 0; did you mean '0'\?",
    ) as info:
        m.load_state_dict({"layers": {0: layer}})
    assert info.value.unexpected_keys == ("layers.0",)
    with pytest.raises(
        tt.StateDictError, match=r"'layers\.7': nested state keys must be strings, got int 7\."
    ):
        m.load_state_dict({"layers": {7: layer}})


def test_zero_size_leaves_load_onto_any_sharding():
    # Regression (found by property_tests): JAX 0.10's device_put of a zero-size array
    # replicated over one device order onto a sharding that splits it over another order made
    # shards of the wrong shape, so the loaded leaf was broken (np.asarray of it failed).
    devices = jax.devices("cpu")
    replicated = NamedSharding(Mesh(np.array(devices[::-1]), ("x",)), PartitionSpec())
    value = jax.device_put(np.zeros((0, 4), np.float32), replicated)
    mesh = jax.make_mesh((2, 4), ("x", "y"), devices=devices)
    target = NamedSharding(mesh, PartitionSpec(None, "y"))

    class Holder(nn.Module):
        w: jax.Array

    model = Holder(jax.device_put(np.zeros((0, 4), np.float32), target))
    loaded = model.load_state_dict({"w": value})
    assert loaded.w.sharding == target
    assert [shard.data.shape for shard in loaded.w.addressable_shards] == [(0, 1)] * 8
    assert np.asarray(loaded.w).shape == (0, 4)


def test_bool_leaves_load_from_bools():
    # regression: a bool value was once taken for a non-numeric one
    class Flags(nn.Module):
        def __init__(self):
            self.mask = jnp.array([True, False])

    f = Flags()
    loaded = f.load_state_dict({"mask": [False, True]})
    np.testing.assert_array_equal(loaded.mask, [False, True])
    assert loaded.mask.dtype == jnp.bool_
    with pytest.raises(
        tt.StateDictError, match=r"'mask': dtype kind changes: the model holds bool"
    ):
        f.load_state_dict({"mask": [1, 0]})


# --- casts that would change values -----------------------------------------------------


def test_negative_integers_out_of_range_are_refused_too():
    # the narrowing check covers both bounds: int64 -1000 into int8 would load as 24
    s = Stack(1, rngs=nn.Rngs(0)).replace(steps=jnp.zeros((), jnp.int8))
    for bad in (-1000, -129, 128):
        with pytest.raises(
            tt.StateDictError, match=r"'steps': narrowing int64 to int8 would change values"
        ):
            s.load_flat_state_dict({"steps": np.array(bad, np.int64)})
    for good in (-128, 127, 0):
        assert int(s.load_flat_state_dict({"steps": np.array(good, np.int64)}).steps) == good


@pytest.mark.parametrize(
    "where, value, leaf, largest",
    [
        ("numpy", np.array([1.0, 1e5], np.float32), jnp.float16, "1e\\+05"),
        ("numpy", np.array([1e300, 2.0], np.float64), jnp.float32, "1e\\+300"),
        ("jax", np.array([7e4, 1.0], np.float32), jnp.float16, "7e\\+04"),
        ("jax", np.array([-3.4e38, 1.0], np.float32), jnp.bfloat16, "3.4e\\+38"),
    ],
)
def test_finite_values_that_would_become_inf_are_refused(where, value, leaf, largest):
    value = jnp.asarray(value) if where == "jax" else value  # (made here, not at import)

    class Holder(nn.Module):
        w: jax.Array

    h = Holder(jnp.zeros(2, leaf))
    name = np.dtype(leaf).name
    with pytest.raises(
        tt.StateDictError,
        match=rf"'w': casting {np.dtype(value.dtype).name} to {name} would turn a value into "
        rf"inf: the largest is {largest}, and {name} holds at most",
    ) as info:
        h.load_state_dict({"w": value})
    assert info.value.problems[0].kind == "dtype"


def test_values_that_fit_and_values_already_infinite_load():
    class Holder(nn.Module):
        w: jax.Array

    h = Holder(jnp.zeros(4, jnp.float16))
    loaded = h.load_state_dict({"w": np.array([65504.0, -1.5, np.inf, np.nan], np.float32)})
    np.testing.assert_array_equal(loaded.w[:3], [65504.0, -1.5, np.inf])
    assert np.isnan(loaded.w[3]) and loaded.w.dtype == jnp.float16
    # inside jit the cast happens as written (the docs say so): no check on traced values
    inside = jax.jit(lambda h, v: h.load_state_dict({"w": v}))(h, jnp.full(4, 1e5))
    assert np.isinf(inside.w).all()


# --- loads that name a few leaves rebuild only their paths ------------------------------


class Blocks(nn.Module):
    def __init__(self, n, *, rngs):
        self.blocks = [MLP(rngs=rngs) for _ in range(n)]
        self.head = nn.Linear(4, 2, rngs=rngs)


@pytest.mark.parametrize("flat", [False, True])
def test_a_small_load_rebuilds_only_the_nodes_on_its_paths(flat, view):
    m = Blocks(5, rngs=nn.Rngs(0))
    donor = Blocks(5, rngs=nn.Rngs(1))
    if flat:
        new = m.load_flat_state_dict({"blocks.3.input.kernel": donor.blocks[3].input.kernel})
    else:
        new = m.load_state_dict(
            {"blocks": {"3": {"input": {"kernel": donor.blocks[3].input.kernel}}}}
        )
    assert new.blocks[3].input.kernel is donor.blocks[3].input.kernel
    assert new is not m and new.blocks[3] is not m.blocks[3]
    assert m.blocks[3].input.kernel is not donor.blocks[3].input.kernel  # m unchanged
    assert type(new.blocks) is list and type(new.blocks[3]) is type(m.blocks[3])
    untouched = [new.head, new.blocks[0], new.blocks[4], new.blocks[3].output]
    originals = [m.head, m.blocks[0], m.blocks[4], m.blocks[3].output]
    if view == "walk":  # the same node objects: nothing off the path was rebuilt
        assert all(a is b for a, b in zip(untouched, originals, strict=True))
    assert leaves_equal(untouched, originals)
    assert jax.tree.structure(new) == jax.tree.structure(m)


def test_walk_and_flat_give_identical_trees_for_every_kind_of_container(monkeypatch):
    class Mixed(nn.Module):
        def __init__(self):
            self.seq = (nn.Linear(2, 2, rngs=nn.Rngs(0)), None)
            self.table = {"b": jnp.ones(2), "a": [jnp.zeros(3), nn.Linear(2, 1, rngs=nn.Rngs(1))]}
            self.name = "static"

    m = Mixed()
    flat = {"seq.0.bias": np.full(2, 5.0), "table.a.1.kernel": np.ones((2, 1)), "table.b": [3, 4]}
    results = []
    for limit in (10**9, -1):
        monkeypatch.setattr(_state, "WALK_LIMIT", limit)
        results.append(
            m.load_flat_state_dict({k: np.asarray(v, np.float32) for k, v in flat.items()})
        )
    walked, flattened = results
    assert jax.tree.structure(walked) == jax.tree.structure(flattened) == jax.tree.structure(m)
    assert leaves_equal(walked, flattened)
    assert walked.seq[1] is None and walked.name == "static"


# --- error messages ---------------------------------------------------------------------


def test_suggestions_prefer_the_same_last_part_and_skip_names_already_given():
    class Net(nn.Module):
        def __init__(self):
            self.conv2 = nn.Linear(2, 2, rngs=nn.Rngs(0))
            self.fc = nn.Sequential(*[nn.Linear(2, 2, rngs=nn.Rngs(i)) for i in range(3)])

    net = Net()
    with pytest.raises(
        tt.StateDictError, match=r"'fc\.2\.bias': unknown key; did you mean 'fc\.layers\.2\.bias'\?"
    ):
        net.load_flat_state_dict({"fc.2.bias": np.zeros(2, np.float32)})
    # a name the same state already supplies is never the suggestion
    given = {"input.kernel": np.zeros((32, 64), np.float32), "input.kernal": np.zeros((32, 64))}
    with pytest.raises(tt.StateDictError) as info:
        MLP(rngs=nn.Rngs(0)).load_flat_state_dict(given)
    assert "did you mean 'input.kernel'" not in str(info.value)


def test_problems_with_names_come_before_problems_with_values():
    m = MLP(rngs=nn.Rngs(0))
    err = error_of(
        lambda: m.load_flat_state_dict(
            {"output.bias": np.zeros(9, np.float32), "input.bias": "x", "nope": 1}
        )
    )
    assert [p.kind for p in err.problems] == ["unknown", "shape", "value"]
    lines = str(err).splitlines()[1:]
    assert [line.split("'")[1] for line in lines] == ["nope", "output.bias", "input.bias"]


@pytest.mark.parametrize("blocks", [10, 20])
def test_the_message_shows_twenty_problems_and_counts_the_rest(blocks):
    """Up to twenty problems are all shown; past twenty, the first twenty and a count."""
    m = Blocks(blocks, rngs=nn.Rngs(0))
    bad = {
        f"blocks.{i}.{p}.bias": np.zeros(9, np.float32)
        for i in range(blocks)
        for p in ("input", "output")
    }
    err = error_of(lambda: m.load_flat_state_dict(bad))
    lines = str(err).splitlines()
    count = 2 * blocks
    assert lines[0] == f"Blocks.load_flat_state_dict(): {count} problems; nothing was loaded."
    if count > 20:
        assert len(lines) == 22 and lines[-1] == f"  ... and {count - 20} more (all in .problems)"
    else:
        assert len(lines) == 1 + count and lines[-1].startswith("  - 'blocks.")
    assert len(err.problems) == count and {p.kind for p in err.problems} == {"shape"}


def test_bad_values_loaded_inside_jit_are_refused_as_outside():
    # the checks of names, shapes and dtype kinds run on traced values too
    m = MLP(rngs=nn.Rngs(0))
    cases = [
        (
            {"output.bias": jnp.zeros(5)},
            r"'output\.bias': shape mismatch: expected \(4,\), got \(5,\)",
        ),
        ({"output.bias": jnp.zeros(4, jnp.int32)}, r"'output\.bias': dtype kind changes"),
        (
            {"output.bais": jnp.zeros(4)},
            r"'output\.bais': unknown key; did you mean 'output\.bias'\?",
        ),
    ]
    for flat, message in cases:
        with pytest.raises(tt.StateDictError, match=message):
            jax.jit(lambda m, s: m.load_flat_state_dict(s))(m, flat)
        with pytest.raises(tt.StateDictError, match=message):
            m.load_flat_state_dict(flat)


def test_tensors_of_other_frameworks_and_python_numbers_load():
    # what the docs promise: array-likes, Python numbers taking the leaf's dtype as JAX's
    # do, and CPU torch tensors of any kind (bfloat16, requiring grad, nn.Parameter)
    import torch

    lin = nn.Linear(2, 3, rngs=nn.Rngs(0))
    reference = torch.nn.Linear(2, 3)
    loaded = lin.load_flat_state_dict({"kernel": reference.weight.T, "bias": reference.bias})
    np.testing.assert_allclose(loaded.kernel, reference.weight.detach().numpy().T)
    bias = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    assert loaded.load_flat_state_dict({"bias": bias}).bias.tolist() == [1.0, 2.0, 3.0]
    half = nn.Linear(2, 3, param_dtype=jnp.bfloat16, rngs=nn.Rngs(0))
    from_bf16 = half.load_flat_state_dict({"bias": torch.ones(3, dtype=torch.bfloat16)})
    assert from_bf16.bias.dtype == jnp.bfloat16 and from_bf16.bias.tolist() == [1, 1, 1]
    source = torch.zeros(3)
    copied = lin.load_flat_state_dict({"bias": source})
    source.fill_(7.0)  # the loaded model does not share the tensor's memory
    assert copied.bias.tolist() == [0.0, 0.0, 0.0]
    assert lin.load_flat_state_dict({"bias": [1, 2, 3]}).bias.dtype == jnp.float32
    with pytest.raises(tt.StateDictError, match=r"'bias': narrowing int64 to float32 would change"):
        lin.load_flat_state_dict({"bias": [2**30 + 1, 0, 0]})  # not exact in float32
    with pytest.raises(tt.StateDictError, match=r"'bias': dtype kind changes"):
        lin.load_flat_state_dict({"bias": np.array([1, 2, 3])})  # an int array is no Python number


class _Detachable:
    """No tensor (it has no __dlpack__), yet it has a detach method."""

    def detach(self):
        return np.zeros(2)

    def __array__(self, dtype=None, copy=None):
        return np.ones(2)


def test_host_array_reads_with_numpy_and_detaches_only_tensors():
    # what a conversion reads a source value with: a torch tensor that requires grad is
    # detached and read by NumPy, bit for bit (float64 kept, not a JAX copy)
    import torch

    from taktiny.state import _values

    grad = torch.nn.Parameter(torch.tensor([1.5, 2.25], dtype=torch.float64))
    read = _values.host_array(grad)
    assert type(read) is np.ndarray and read.dtype == np.float64 and read.tolist() == [1.5, 2.25]
    # other DLPack producers have no detach method: NumPy reads them as they are
    for value in (np.arange(3), jnp.arange(3)):
        read = _values.host_array(value)
        assert type(read) is np.ndarray and read.tolist() == [0, 1, 2]
    # what is no tensor is read as NumPy reads it, whatever methods it has
    assert _values.host_array(_Detachable()).tolist() == [1.0, 1.0]


# --- values of every origin -------------------------------------------------------------


class One(nn.Module):
    w: jax.Array


class _Exported:
    """Exposes its memory through DLPack only, as a CuPy array does: no ``__array__`` for
    NumPy to read, and no torch-style ``detach``."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_values_exported_only_through_dlpack_load_as_copies():
    source = np.arange(3, dtype=np.float32)
    loaded = One(jnp.zeros(3)).load_state_dict({"w": _Exported(source)})
    assert isinstance(loaded.w, jax.Array) and loaded.w.dtype == jnp.float32
    np.testing.assert_array_equal(loaded.w, np.arange(3, dtype=np.float64))
    source[...] = 7.0  # the loaded model does not share the exporter's memory
    np.testing.assert_array_equal(loaded.w, np.arange(3, dtype=np.float64))


@pytest.mark.parametrize(
    "leaf, value, refused",
    [
        (jnp.float32, [2**24, -3], None),
        (jnp.float32, [2**60 + 1, 0], "int64 to float32"),  # rounds to 2**60, as in float64
        (jnp.uint8, [255, 0], None),
        (jnp.uint8, [-1, 0], "int64 to uint8"),
        (jnp.complex64, [1, -2], None),
        (jnp.complex64, [1.5, float("nan")], None),
        (jnp.complex64, [1e300, 0.0], "float64 to complex64"),  # would become inf
    ],
)
def test_python_numbers_load_into_another_kind_only_when_every_value_is_kept(leaf, value, refused):
    """Python numbers take the leaf's dtype, of another kind too (int into float, unsigned
    or complex; float into complex), when the cast keeps every value (NaN stays NaN);
    otherwise the load is refused. The check itself warns of nothing."""
    model = One(jnp.zeros(2, leaf))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if refused is None:
            loaded = model.load_state_dict({"w": value})
            assert loaded.w.dtype == leaf
            np.testing.assert_array_equal(loaded.w, np.asarray(value, np.complex128))
            return
        with pytest.raises(tt.StateDictError) as info:
            model.load_state_dict({"w": value})
    assert [str(p) for p in info.value.problems] == [
        f"'w': narrowing {refused} would change values; convert the value yourself."
    ]


# --- what the walk finds, beside entries that load --------------------------------------
# (a walk that supplies nothing hands the whole load to the flat view: these states name a
# good leaf too, so that each view reports its own findings)


class Pair(NamedTuple):
    a: jax.Array
    b: jax.Array


class Tree(nn.Module):
    def __init__(self):
        self.layers = [nn.Linear(2, 2, rngs=nn.Rngs(i)) for i in range(3)]
        self.pair = Pair(jnp.zeros(2), jnp.ones(2))  # a PyTree node that is no list or dict
        self.bias = jnp.zeros(2)


@pytest.mark.parametrize(
    "flat, group, problem",
    [
        (
            False,
            ("layers",),
            "'layers': expected a dict of this submodule's parameters (keys ['0', '1', '2']), "
            "got an array float32[3].",
        ),
        (
            False,
            ("layers", "1"),
            "'layers.1': expected a dict of this submodule's parameters (keys ['kernel', "
            "'bias']), got an array float32[3].",
        ),
        (
            False,
            ("pair",),
            "'pair': expected a dict of this submodule's parameters (keys ['a', 'b']), got an "
            "array float32[3].",
        ),
        (
            True,
            ("layers.1.kernal",),
            "'layers.1.kernal': unknown key; did you mean 'layers.1.kernel'?",
        ),
    ],
)
def test_a_group_given_an_array_lists_its_keys_and_an_unknown_name_gets_a_suggestion(
    flat, group, problem
):
    """A group given one array names the keys it holds (a list's positions, a module's
    fields, any other PyTree node's keys); an unknown name gets the closest known one."""
    model = Tree()
    state = jnp.zeros(3)
    for key in reversed(group):  # {"layers": {"1": array}}
        state = {key: state}
    load = model.load_flat_state_dict if flat else model.load_state_dict
    with pytest.raises(tt.StateDictError) as info:
        load({**state, "bias": np.ones(2, np.float32)})
    assert [str(p) for p in info.value.problems] == [problem]


@pytest.mark.parametrize("flat", [False, True])
def test_leaves_of_any_pytree_node_load_by_their_key_names(flat, view):
    model = Tree()
    b, bias = np.array([5.0, 6.0], np.float32), np.ones(2, np.float32)
    if flat:
        new = model.load_flat_state_dict({"pair.b": b, "bias": bias})
    else:
        new = model.load_state_dict({"pair": {"b": b}, "bias": bias})
    assert type(new.pair) is Pair and new.pair.a is model.pair.a
    np.testing.assert_array_equal(new.pair.b, b)
    np.testing.assert_array_equal(new.bias, bias)
    assert leaves_equal(new.layers, model.layers)
    if view == "walk":  # nothing off the paths named is rebuilt
        assert all(x is y for x, y in zip(new.layers, model.layers, strict=True))


# --- custom parameters below the root, with parts nested in them -------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
    value: jax.Array
    range: dict  # {"lo": ..., "hi": ...}: parts named "range.lo", "range.hi"


class QuantizedDense(nn.Module):
    def __init__(self):
        self.bias = jnp.zeros(3)  # first: the custom parameter's leaves start at position 1
        self.kernel = Quantized(jnp.ones((2, 3), jnp.int8), {"lo": jnp.zeros(3), "hi": jnp.ones(3)})


class Outer(nn.Module):
    def __init__(self):
        self.block = QuantizedDense()


@pytest.mark.parametrize("form", ["flat", "parts", "whole"])
def test_custom_parameters_below_the_root_load_by_nested_part_and_whole(form):
    m = Outer()
    lo, value = np.full(3, -2.0, np.float32), np.full((2, 3), 5, np.int8)
    bias = np.arange(3, dtype=np.float32)
    if form == "flat":
        new = m.load_flat_state_dict({"block.kernel.range.lo": lo, "block.bias": bias})
    elif form == "parts":
        new = m.load_state_dict({"block": {"kernel": {"range": {"lo": lo}}, "bias": bias}})
    else:
        whole = Quantized(m.block.kernel.value, {"lo": lo, "hi": m.block.kernel.range["hi"]})
        new = m.load_state_dict({"block": {"kernel": whole, "bias": bias}})
    assert isinstance(new.block.kernel, Quantized)
    assert jax.tree.structure(new) == jax.tree.structure(m)
    np.testing.assert_array_equal(new.block.kernel.range["lo"], lo)
    np.testing.assert_array_equal(new.block.bias, bias)
    assert new.block.kernel.value is m.block.kernel.value
    assert new.block.kernel.range["hi"] is m.block.kernel.range["hi"]
    both = m.load_flat_state_dict({"block.kernel.value": value, "block.kernel.range.hi": lo})
    np.testing.assert_array_equal(both.block.kernel.value, value)
    np.testing.assert_array_equal(both.block.kernel.range["hi"], lo)
    assert both.block.kernel.range["lo"] is m.block.kernel.range["lo"]
    assert both.block.bias is m.block.bias


def test_problems_inside_custom_parameters_name_their_full_path():
    m = Outer()
    good = {"bias": np.ones(3, np.float32)}
    parts = "this parameter's parts are ['value', 'range.hi', 'range.lo']"
    treedef = jax.tree.structure(m.block.kernel)
    cases = [
        ({"kernel": {"zero": 1}}, [f"'block.kernel.zero': unknown key; {parts}."]),
        (
            {"kernel": {"range": {"mid": 1, "lo": np.ones(3, np.float32)}}},
            [f"'block.kernel.range.mid': unknown key; {parts}."],
        ),
        (
            {"kernel": {"range": {"lo": {"x": 1}}}},  # a part's name takes its value as it is
            [
                "'block.kernel.range.lo': expected an array, got a dict with keys ['x']; this "
                "name is one array."
            ],
        ),
        (
            {"kernel": {"value": {"x": 1}}},
            [
                "'block.kernel.value': expected an array, got a dict with keys ['x']; this "
                "name is one array."
            ],
        ),
        (
            {"kernel": [np.ones(3)]},
            [
                f"'block.kernel': expected a value structured as {treedef}, got "
                f"{jax.tree.structure([0])}."
            ],
        ),
    ]
    for state, problems in cases:
        with pytest.raises(tt.StateDictError) as info:
            m.load_state_dict({"block": {**state, **good}})
        assert [str(p) for p in info.value.problems] == problems


@pytest.mark.parametrize("dotted", [False, True])
@pytest.mark.parametrize(("strict", "abstract"), [(False, True), (True, False), (False, False)])
def test_a_load_resolves_its_names_once(monkeypatch, view, dotted, strict, abstract):
    """The view is chosen before any name is resolved: a partial load into an abstract tree
    (which must list every leaf left unfilled) resolves once, as every other load does."""
    leaf = jax.ShapeDtypeStruct((2,), jnp.float32) if abstract else jnp.ones(2)
    tree = {"a": leaf, "b": {"c": leaf, "d": leaf}}
    calls = []
    real = _state.resolve
    monkeypatch.setattr(_state, "resolve", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    state = {"b.c": np.zeros(2, np.float32)} if dotted else {"b": {"c": np.zeros(2, np.float32)}}
    if strict or abstract:
        kind = "missing" if strict else "abstract"
        with pytest.raises(tt.StateDictError, match=r"2 problems") as caught:
            _state.load(tree, state, strict=strict, flat=dotted)
        assert [(p.kind, p.name) for p in caught.value.problems] == [(kind, "a"), (kind, "b.d")]
    else:
        loaded = _state.load(tree, state, strict=strict, flat=dotted)
        assert np.asarray(loaded["b"]["c"]).tolist() == [0.0, 0.0]
    assert len(calls) == 1
    assert type(calls[0]).__name__ == ("Flat" if strict or view == "flat" else "Walk")
