"""How a load chooses its path (a walk to the few leaves named, or one flatten of the whole
tree), and where the values it checks end up: their shardings, dtypes and memory."""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import MLP
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

import taktiny as tt
from taktiny import nn
from taktiny.state import _state, _values


class Blocks(nn.Module):
    def __init__(self, *, rngs):
        self.blocks = [MLP(rngs=rngs), MLP(rngs=rngs)]
        self.head = nn.Linear(4, 2, rngs=rngs)


_NAMES = [("input", "kernel"), ("input", "bias"), ("output", "kernel"), ("output", "bias")]


def _state_of(donor, n, form):
    """A state naming the first `n` leaves of donor.blocks[0], flat or nested (in plain dicts
    or in read-only mappings, which count the same)."""
    leaves = [(sub, p, getattr(getattr(donor.blocks[0], sub), p)) for sub, p in _NAMES[:n]]
    if form == "flat":
        return {f"blocks.0.{sub}.{p}": value for sub, p, value in leaves}
    block: dict = {}
    for sub, p, value in leaves:
        block.setdefault(sub, {})[p] = value
    if form == "dict":
        return {"blocks": {"0": block}}
    proxy = types.MappingProxyType
    return proxy({"blocks": proxy({"0": proxy({k: proxy(v) for k, v in block.items()})})})


@pytest.mark.parametrize("form", ["flat", "dict", "mapping"])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_a_partial_load_walks_only_when_it_names_at_most_walk_limit_leaves(form, n, monkeypatch):
    """A non-strict load naming at most WALK_LIMIT leaves (counted through nested dicts and
    any other mappings) walks to them and keeps every untouched submodule as the same object;
    one naming more flattens the whole tree and rebuilds every node. Either way the same
    values load."""
    monkeypatch.setattr(_state, "WALK_LIMIT", 3)
    m, donor = Blocks(rngs=nn.Rngs(0)), Blocks(rngs=nn.Rngs(1))
    state = _state_of(donor, n, form)
    new = m.load_flat_state_dict(state) if form == "flat" else m.load_state_dict(state)
    untouched, originals = [new.head, new.blocks[1]], [m.head, m.blocks[1]]
    assert [a is b for a, b in zip(untouched, originals, strict=True)] == [n <= 3] * 2
    assert all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(untouched), jax.tree.leaves(originals), strict=True)
    )
    for sub, p in _NAMES[:n]:
        loaded = getattr(getattr(new.blocks[0], sub), p)
        assert loaded is getattr(getattr(donor.blocks[0], sub), p)
    for sub, p in _NAMES[n:]:
        kept = getattr(getattr(new.blocks[0], sub), p)
        assert kept is getattr(getattr(m.blocks[0], sub), p)


class Trio(nn.Module):
    a: jax.Array
    b: jax.Array
    c: jax.Array


@pytest.mark.parametrize("partial", [False, True])
def test_each_loaded_array_takes_the_sharding_of_the_leaf_it_replaces(partial):
    """Every value ends on its own leaf's sharding, also when several leaves and values share
    sharding objects: a value already placed like one leaf is still moved for another."""
    cpus = jax.devices("cpu")
    on0, on5 = SingleDeviceSharding(cpus[0]), SingleDeviceSharding(cpus[5])

    def put(x, sharding):
        return jax.device_put(np.full(3, x, np.float32), sharding)

    m = Trio(put(1, on0), put(2, on0), put(3, on5))
    state = {"a": put(4, on0), "b": put(5, on5), "c": put(6, on0)}
    if partial:  # the walk's path; the full load takes the in-order path
        state.pop("a")
    new = m.load_state_dict(state)
    for name in state:
        assert getattr(new, name).sharding == getattr(m, name).sharding
        np.testing.assert_array_equal(getattr(new, name), state[name])


class Holder(nn.Module):
    w: jax.Array


@pytest.mark.parametrize("dtype", [np.int32, jnp.bfloat16, np.bool_, np.uint8])
@pytest.mark.parametrize("sharded", [False, True])
def test_zero_size_leaves_keep_their_dtype(dtype, sharded):
    """A zero-size value, placed afresh, gets the dtype of the leaf it replaces."""
    leaf = jnp.zeros((0, 4), dtype)
    if sharded:
        mesh = jax.make_mesh((2, 4), ("x", "y"), devices=jax.devices("cpu"))
        leaf = jax.device_put(leaf, NamedSharding(mesh, PartitionSpec(None, "y")))
    model = Holder(leaf)
    for value in (np.zeros((0, 4), dtype), jax.device_put(jnp.zeros((0, 4), dtype), None)):
        loaded = model.load_state_dict({"w": value}).w
        assert loaded.dtype == np.dtype(dtype) and loaded.shape == (0, 4)
        assert loaded.sharding == leaf.sharding
        assert np.asarray(loaded).dtype == np.dtype(dtype)


@pytest.mark.parametrize("flat", [False, True])
def test_problems_of_a_full_load_in_leaf_order_name_the_call(flat):
    """A strict load of a state naming every leaf in order (the fast path) reports its
    problems under the name of the call, like any other load."""
    m = MLP(rngs=nn.Rngs(0))
    state = m.flat_state_dict() if flat else m.state_dict()
    if flat:
        state["output.bias"] = np.zeros(5, np.float32)
    else:
        state["output"]["bias"] = np.zeros(5, np.float32)
    method = "load_flat_state_dict" if flat else "load_state_dict"
    expected = (
        f"MLP.{method}(): 1 problem; nothing was loaded.\n"
        "  - 'output.bias': shape mismatch: expected (4,), got (5,)."
    )
    with pytest.raises(tt.StateDictError, match=f"^{re.escape(expected)}$"):
        getattr(m, method)(state, strict=True)


class Between(nn.Module):
    """Single leaves on either side of a submodule: runs of one leaf in the nested state."""

    def __init__(self, *, rngs):
        self.scale = jnp.ones(3)
        self.mlp = MLP(rngs=rngs)
        self.shift = jnp.zeros(2)


@pytest.mark.parametrize("model", [Blocks, Between])
@pytest.mark.parametrize("flat", [False, True])
def test_a_full_load_in_leaf_order_resolves_no_name_and_converts_no_array(flat, model, monkeypatch):
    """The fast paths that bench/ times: a strict load of a state shaped like the model's own
    gathers its values in leaf order without resolving a single name, and an array that
    already has its leaf's shape, dtype and sharding goes in as it is, unconverted."""
    m, donor = model(rngs=nn.Rngs(0)), model(rngs=nn.Rngs(1))
    state = donor.flat_state_dict() if flat else donor.state_dict()

    def slow_path(*args, **kwargs):
        raise AssertionError("a full load in leaf order took the slow path")

    monkeypatch.setattr(_state, "resolve", slow_path)
    monkeypatch.setattr(_values, "checked_value", slow_path)
    new = (
        m.load_flat_state_dict(state, strict=True)
        if flat
        else m.load_state_dict(state, strict=True)
    )
    pairs = zip(jax.tree.leaves(new), jax.tree.leaves(donor), strict=True)
    assert all(loaded is given for loaded, given in pairs)


def test_concrete_values_load_into_a_traced_model_inside_jit():
    """Inside jit, NumPy values loaded into a model passed to the jitted function become part
    of the traced result (cast to the leaf's dtype), as values passed in would."""
    m = Holder(jnp.ones(3, jnp.float32))

    @jax.jit
    def load(model):
        loaded = model.load_state_dict({"w": np.full(3, 2, np.int8)}, strict=True)
        return loaded.w * 2

    with pytest.raises(tt.StateDictError, match=r"'w': dtype kind changes"):
        load(m)
    out = jax.jit(lambda model: model.load_state_dict({"w": np.full(3, 2.0)}).w * 2)(m)
    np.testing.assert_array_equal(out, np.full(3, 4.0, np.float32))
    assert out.dtype == np.float32
