"""The two forms of a stack's state: stacked names and per-layer names, read and loaded
(whole, or some layers: only their slices change), checked per layer, in schemas, and in
an optimizer state that follows the model."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import taktiny as tt
from taktiny import nn
from taktiny.state import Flat, Layers, _state


class Block(nn.Module):
    def __init__(self, *, rngs: nn.Rngs):
        self.dense = nn.Linear(4, 4, rngs=rngs)
        self.norm = nn.RMSNorm(4)

    def __call__(self, x):
        return self.norm(x + self.dense(x))


class Model(nn.Module):
    def __init__(self, count: int = 3, *, rngs: nn.Rngs):
        self.head = nn.Linear(4, 2, rngs=rngs)
        self.layers = nn.Stack(lambda rngs: Block(rngs=rngs), count, rngs=rngs)


class Unrolled(nn.Module):
    def __init__(self, layers, head):
        self.head = head
        self.layers = layers


def unrolled(model):
    return Unrolled([model.layers[i] for i in range(len(model.layers))], model.head)


def test_stacked_names_and_per_layer_names():
    model = Model(rngs=nn.Rngs(0))
    assert {k: v.shape for k, v in tt.flat_state_dict(model).items()} == {
        "head.kernel": (4, 2),
        "head.bias": (2,),
        "layers.block.dense.kernel": (3, 4, 4),
        "layers.block.dense.bias": (3, 4),
        "layers.block.norm.scale": (3, 4),
    }
    per_layer = model.flat_state_dict(unstacked=True)
    # the names and order of a list of the same blocks
    assert list(per_layer) == list(tt.flat_state_dict(unrolled(model)))
    for name, value in tt.flat_state_dict(unrolled(model)).items():
        np.testing.assert_array_equal(per_layer[name], value)
    nested = model.state_dict(unstacked=True)
    assert set(nested["layers"]) == {"0", "1", "2"}
    np.testing.assert_array_equal(
        nested["layers"]["2"]["dense"]["kernel"], model.layers[2].dense.kernel
    )
    abstract = tt.flat_state_dict(jax.eval_shape(lambda: Model(rngs=nn.Rngs(0))), unstacked=True)
    assert abstract["layers.1.dense.kernel"].shape == (4, 4)


@pytest.mark.parametrize("abstract", [False, True])
def test_both_loads_ask_one_per_layer_form(abstract):
    """state.Layers is the one description of a model's per-layer form: each name of its
    twin (the streamed load resolves a checkpoint against it) is, as `slice_of` says, a
    layer of a stacked leaf, held as `layer` says (the leaf the load of values checks each
    slice against), named as flat_state_dict(unstacked=True) names it, in its order."""
    make = lambda: Model(rngs=nn.Rngs(0))
    model = jax.eval_shape(make) if abstract else make()
    layers = Layers(model, Flat(model))
    twin = tt.flat_state_dict(layers.twin)
    assert list(twin) == list(tt.flat_state_dict(model, unstacked=True))
    stacked = tt.flat_state_dict(model)
    for name, leaf in twin.items():
        if not name.startswith("layers."):
            assert layers.slice_of(name) is None and leaf is stacked[name]
            continue
        _, index, rest = name.split(".", 2)
        assert layers.slice_of(name) == (f"layers.block.{rest}", int(index))
        assert leaf == layers.layer(f"layers.block.{rest}")
        assert leaf.shape == stacked[f"layers.block.{rest}"].shape[1:]
        assert isinstance(leaf, jax.ShapeDtypeStruct) == abstract
    for name in ("layers.3.dense.kernel", "layers.block.dense.kernel", "layers.0.dense.nope"):
        assert layers.slice_of(name) is None
    assert layers.covered(twin) == {n for n in stacked if n.startswith("layers.")}
    assert layers.covered(n for n in twin if not n.startswith("layers.2.")) == set()


def test_a_load_takes_either_form():
    model, other = Model(rngs=nn.Rngs(0)), Model(rngs=nn.Rngs(1))
    for state in (other.flat_state_dict(), other.flat_state_dict(unstacked=True)):
        loaded = tt.load_flat_state_dict(model, state, strict=True)
        assert jax.tree.all(jax.tree.map(np.array_equal, loaded, other))
    nested = tt.load_state_dict(model, other.state_dict(unstacked=True), strict=True)
    assert jax.tree.all(jax.tree.map(np.array_equal, nested, other))
    host = {k: np.asarray(v) for k, v in other.flat_state_dict(unstacked=True).items()}
    assert jax.tree.all(jax.tree.map(np.array_equal, model.load_flat_state_dict(host), other))


def test_some_layers_change_only_their_slices():
    model, other = Model(rngs=nn.Rngs(0)), Model(rngs=nn.Rngs(1))
    state = {
        k: v for k, v in other.flat_state_dict(unstacked=True).items() if k.startswith("layers.1.")
    }
    loaded = tt.load_flat_state_dict(model, state)
    for name, leaf in tt.flat_state_dict(loaded).items():
        old, new = tt.flat_state_dict(model)[name], tt.flat_state_dict(other)[name]
        if name.startswith("layers."):
            np.testing.assert_array_equal(leaf[1], new[1])
            np.testing.assert_array_equal(leaf[0], old[0])
            np.testing.assert_array_equal(leaf[2], old[2])
        else:
            assert leaf is old  # the other leaves are the model's own arrays
    one = tt.load_flat_state_dict(model, {"layers.2.norm.scale": jnp.full(4, 7.0)})
    np.testing.assert_array_equal(one.layers.block.norm.scale[2], np.full(4, 7.0))
    np.testing.assert_array_equal(
        one.layers.block.norm.scale[:2], model.layers.block.norm.scale[:2]
    )
    np.testing.assert_array_equal(model.layers.block.norm.scale[2], np.ones(4))  # not changed


@pytest.mark.parametrize("given", ["stacked", "per layer", "one layer"])
def test_a_load_into_a_stack_flattens_it_once(flattens, given):
    """Restacking per-layer names, resolving them, checking that every leaf is named and
    writing the new tree use one flatten of the tree, whether the load names every leaf
    or a few (which otherwise walk to them)."""
    model = Model(rngs=nn.Rngs(0))
    flat = tt.flat_state_dict(model, unstacked=given != "stacked")
    strict = given != "one layer"
    if not strict:
        flat = {n: v for n, v in flat.items() if n.startswith("layers.1.")}
    tt.load_flat_state_dict(model, flat, strict=strict)  # (its description made, and cached)
    calls = flattens(model)
    loaded = tt.load_flat_state_dict(model, flat, strict=strict)
    assert calls == ["tree_flatten"]
    assert jax.tree.all(jax.tree.map(np.array_equal, loaded, model))


def test_inside_jit_a_layer_loads_into_its_slice():
    model = Model(rngs=nn.Rngs(0))
    load = jax.jit(lambda m, k: m.load_flat_state_dict({"layers.0.dense.kernel": k}))
    loaded = load(model, jnp.ones((4, 4)))
    np.testing.assert_array_equal(loaded.layers.block.dense.kernel[0], np.ones((4, 4)))
    np.testing.assert_array_equal(
        loaded.layers.block.dense.kernel[1:], model.layers.block.dense.kernel[1:]
    )


def test_per_layer_problems_are_named_per_layer():
    model = Model(rngs=nn.Rngs(0))
    with pytest.raises(
        tt.StateDictError,
        match=r"'layers\.1\.dense\.kernel': shape mismatch: expected \(4, 4\), got \(4, 5\)",
    ):
        model.load_flat_state_dict({"layers.1.dense.kernel": np.zeros((4, 5), np.float32)})
    with pytest.raises(tt.StateDictError, match=r"'layers\.0\.dense\.bias'.*dtype"):
        model.load_flat_state_dict({"layers.0.dense.bias": np.zeros(4, np.int32)})
    both = {
        "layers.block.norm.scale": np.ones((3, 4), np.float32),
        "layers.0.norm.scale": np.ones(4, np.float32),
    }
    with pytest.raises(
        tt.StateDictError,
        match=r"'layers\.block\.norm\.scale': given both whole and per layer \('layers\.0\.norm\.scale'\)",
    ):
        model.load_flat_state_dict(both)
    with pytest.raises(
        tt.StateDictError,
        match=r"'layers': this state holds 4 layers at 'layers', per layer .*; the model holds a "
        r"stack of 3 layers there .* or leave out layer 3\.$",
    ):  # (a layer past the stack's last)
        model.load_flat_state_dict({"layers.3.dense.kernel": np.zeros((4, 4), np.float32)})
    abstract = jax.eval_shape(lambda: Model(rngs=nn.Rngs(0)))
    with pytest.raises(
        tt.StateDictError,
        match=r"(?s)'layers\.0\.dense\.kernel': not supplied, while layer 1 of 'layers\.block\.dense\.kernel' is: the model is abstract.*'layers\.2\.dense\.kernel'",
    ):
        tt.load_flat_state_dict(abstract, {"layers.1.dense.kernel": np.zeros((4, 4), np.float32)})
    with pytest.raises(
        tt.StateDictError, match=r"'layers\.1\.norm\.scale': not supplied, while layers 0, 2"
    ):
        state = model.flat_state_dict(unstacked=True)
        del state["layers.1.norm.scale"]
        tt.load_flat_state_dict(abstract, state, strict=True)


def test_a_key_that_is_not_a_string_beside_per_layer_names_is_one_problem():
    """Restacking per-layer names keeps other keys as given for the resolution to report,
    whatever their type (the thorough fuzz profile met an int key beside per-layer names;
    `_state.load` is called as the methods call it, below their ``Mapping[str, Any]``)."""
    model = Model(rngs=nn.Rngs(0))
    state = {7: np.zeros(4, np.float32), "layers.1.norm.scale": np.ones(4, np.float32)}
    with pytest.raises(tt.StateDictError, match=r"1 problem;.*\n  - '7': ") as info:
        _state.load(model, state, strict=False, flat=True)
    assert [p.kind for p in info.value.problems] == ["key"]


def test_some_layers_under_strict_are_missing_the_others():
    """strict=True asks for every layer: a state of some layers is refused, naming each layer
    left out, not written into a copy of the stacked leaves (which keeps the others)."""
    model = Model(count=4, rngs=nn.Rngs(0))
    three = Model(count=3, rngs=nn.Rngs(1)).flat_state_dict(unstacked=True)
    hint = "missing: strict=True requires every parameter; supply it, or pass strict=False"
    for load in (
        lambda: model.load_flat_state_dict(three, strict=True),
        lambda: model.load_state_dict(Model(count=3, rngs=nn.Rngs(1)).state_dict(unstacked=True),
                                      strict=True),
    ):  # fmt: skip
        with pytest.raises(tt.StateDictError) as info:
            load()
        assert info.value.missing_keys == (
            "layers.3.dense.kernel", "layers.3.dense.bias", "layers.3.norm.scale"
        )  # fmt: skip
        assert all(p.hint.startswith(hint) for p in info.value.problems)
    loaded = model.load_flat_state_dict(three)  # (without strict: the others kept)
    np.testing.assert_array_equal(loaded.layers.block.dense.kernel[3], model.layers[3].dense.kernel)


@pytest.mark.parametrize("bits, group_size", [(4, 2), (4, None), (8, None)])
def test_a_stacked_qarray_reads_per_layer_as_qarrays_and_loads_back_bitwise(bits, group_size):
    """state_dict(unstacked=True) gives each layer of a stacked QArray as the QArray a list of
    the same blocks holds (not a dict of its parts), and that state loads back bit for bit
    into the stack (concrete, abstract) and into the list of blocks; the flat state keeps
    naming the parts."""
    quantize = lambda m: tt.quantize(m, bits=bits, group_size=group_size, where="layers.**")
    model = quantize(Model(rngs=nn.Rngs(0)))
    state = model.state_dict(unstacked=True)
    for i in range(3):
        layer = state["layers"][str(i)]["dense"]["kernel"]
        want = model.layers[i].dense.kernel
        assert isinstance(layer, tt.QArray) and repr(layer) == repr(want)
        assert bitwise(layer, want)
    flat = model.flat_state_dict(unstacked=True)
    assert "layers.1.dense.kernel.value" in flat and "layers.1.dense.kernel" not in flat
    other = quantize(Model(rngs=nn.Rngs(1)))
    abstract = jax.eval_shape(lambda: quantize(Model(rngs=nn.Rngs(1))))
    for target in (other, abstract):
        assert bitwise(tt.load_state_dict(target, state, strict=True), model)
        assert bitwise(tt.load_flat_state_dict(target, flat, strict=True), model)
    some = {"layers": {"1": state["layers"]["1"]}}  # one layer: only its slices change
    mixed = other.load_state_dict(some)
    assert bitwise(mixed.layers[1], model.layers[1]) and bitwise(mixed.layers[0], other.layers[0])
    listed = quantize(unrolled(Model(rngs=nn.Rngs(1))))
    assert bitwise(listed.load_state_dict(state, strict=True), unrolled(model))
    assert tt.state_dict(abstract, unstacked=True)["layers"]["2"]["dense"]["kernel"].shape == (4, 4)


def bitwise(a, b):
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        x.dtype == y.dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in pairs
    )


@pytest.mark.parametrize(("bits", "group_size"), [(8, None), (4, 2)])
def test_a_float_stack_loads_into_a_quantized_one_each_layer_quantized(bits, group_size):
    """match_quantization=True quantizes a float stack's state as the model's stacked
    QArray is, layer by layer: bitwise tt.quantize of the float stack (it quantized the
    layer axis as the first axis of one array, and refused a group size the layer count
    does not divide)."""
    model = Model(rngs=nn.Rngs(0))
    quantized = tt.quantize(model, bits=bits, group_size=group_size, where="layers.**")
    other = tt.quantize(Model(rngs=nn.Rngs(1)), bits=bits, group_size=group_size, where="layers.**")
    loaded = other.load_flat_state_dict(tt.flat_state_dict(model), match_quantization=True)
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(quantized), strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_the_schema_marks_a_stack_s_leaves_and_survives_json():
    schema = tt.schema(Model(rngs=nn.Rngs(0)))
    assert schema["layers.block.dense.kernel"]["stack"] == {"path": "layers", "count": 3}
    assert "stack" not in schema["head.kernel"]
    again = tt.Schema.from_json(schema.to_json())
    assert again == schema and again["layers.block.norm.scale"]["stack"]["count"] == 3
    entry = json.loads(schema.to_json())
    entry["tensors"]["layers.block.norm.scale"]["stack"]["count"] = 5
    with pytest.raises(
        ValueError,
        match=r"'stack' is \{'path': the stack's name, 'count': the size of the first axis\}",
    ):
        tt.Schema.from_json(json.dumps(entry))
    changes = tt.schema(unrolled(Model(rngs=nn.Rngs(0)))).changes(schema)
    assert "float32[3, 4, 4], stacked: 3 layers of 'layers' on axis 0" in "\n".join(
        map(str, changes)
    )


def test_an_optimizer_state_follows_per_layer(optax_promotion):
    model = Model(rngs=nn.Rngs(0))
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(model)
    names = tt.flat_state_dict(opt_state, unstacked=True)
    assert "0.mu.layers.2.dense.kernel" in names and names["0.mu.layers.2.dense.kernel"].shape == (
        4,
        4,
    )
    moved = {k: v + 1 if k.startswith("0.mu.layers.") else v for k, v in names.items()}
    loaded = tt.load_flat_state_dict(opt_state, moved, strict=True)
    np.testing.assert_array_equal(loaded[0].mu.layers.block.dense.kernel, np.ones((3, 4, 4)))


def test_some_layers_load_into_a_stack_on_a_mesh_of_explicit_axes():
    mesh = jax.sharding.Mesh(
        np.array(jax.devices()), ("x",), axis_types=(jax.sharding.AxisType.Explicit,)
    )
    stack = nn.Stack(lambda rngs: nn.Linear(2, 8, rngs=rngs), 3, rngs=nn.Rngs(0))
    rules = {"layers.*.bias": jax.sharding.PartitionSpec(),
             "layers.*.kernel": jax.sharding.PartitionSpec(None, "x")}  # fmt: skip
    model = tt.shard({"layers": stack}, rules, mesh)
    loaded = tt.load_flat_state_dict(model, {"layers.1.bias": np.ones(8, np.float32)})
    np.testing.assert_array_equal(loaded["layers"].block.bias, np.eye(3, 1, -1) * np.ones(8))
    assert loaded["layers"].block.bias.sharding == model["layers"].block.bias.sharding


def test_traced_layers_load_into_a_concrete_model_closed_over():
    """Inside jit, traced values for some layers of a model the function closes over (its
    stacked leaves concrete, on one CPU device) are set into those layers."""
    model, other = Model(rngs=nn.Rngs(0)), Model(rngs=nn.Rngs(1))
    kernel = other.layers.block.dense.kernel[1]
    loaded = jax.jit(lambda k: model.load_flat_state_dict({"layers.1.dense.kernel": k}))(kernel)
    np.testing.assert_array_equal(loaded.layers.block.dense.kernel[1], kernel)
    np.testing.assert_array_equal(
        loaded.layers.block.dense.kernel[0], model.layers.block.dense.kernel[0]
    )
    np.testing.assert_array_equal(
        loaded.layers.block.dense.kernel[2], model.layers.block.dense.kernel[2]
    )


@pytest.mark.parametrize("some", [False, True])
def test_layers_given_as_device_arrays_fill_a_sharded_stack_and_stay_the_caller_s(some):
    """A load of values writes the layers into a sharded stacked leaf on its devices (the
    one fill of both loads): the result keeps the leaf's sharding, and neither the arrays
    given nor the model's own leaves are donated to the writes."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    rules = {
        "layers.*.dense.kernel": jax.sharding.PartitionSpec(None, "model"),
        "**": jax.sharding.PartitionSpec(),
    }
    model = tt.shard(Model(rngs=nn.Rngs(0)), rules, mesh)
    other = Model(rngs=nn.Rngs(1))
    given = {k: jnp.asarray(v) for k, v in other.flat_state_dict(unstacked=True).items()}
    if some:
        given = {k: v for k, v in given.items() if k.startswith("layers.2.")}
    loaded = model.load_flat_state_dict(given)
    kernel = loaded.layers.block.dense.kernel
    assert kernel.sharding == model.layers.block.dense.kernel.sharding
    np.testing.assert_array_equal(kernel[2], other.layers.block.dense.kernel[2])
    want = model if some else other
    np.testing.assert_array_equal(kernel[:2], want.layers.block.dense.kernel[:2])
    assert not any(v.is_deleted() for v in given.values())
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(model))


def test_a_stacked_quantized_parameter_given_whole_beside_layers_is_cut_into_them():
    """A load of values cuts a stacked QArray given whole (nested), or the float array a
    quantized stack is made from (with match_quantization), into its layers beside other
    leaves given per layer, as it cuts a stacked leaf; its shape is checked as the
    stacked parameter's."""
    model = tt.quantize(Model(rngs=nn.Rngs(0)), bits=8, where="layers.**")
    floats = Model(rngs=nn.Rngs(1))
    other = tt.quantize(floats, bits=8, where="layers.**")
    state = {"layers": {"0": other.state_dict(unstacked=True)["layers"]["0"],
                        "block": {"dense": {"kernel": other.layers.block.dense.kernel}}}}  # fmt: skip
    loaded = model.load_state_dict(state, strict=False)
    want = other.layers.block.dense.kernel
    np.testing.assert_array_equal(loaded.layers.block.dense.kernel.value, want.value)
    np.testing.assert_array_equal(loaded.layers.block.dense.kernel.scale, want.scale)
    flat = {
        n: v for n, v in floats.flat_state_dict(unstacked=True).items() if "dense.kernel" not in n
    }
    flat["layers.block.dense.kernel"] = floats.layers.block.dense.kernel
    loaded = model.load_flat_state_dict(flat, strict=True, match_quantization=True)
    assert jax.tree.all(jax.tree.map(np.array_equal, loaded, other))
    flat["layers.block.dense.kernel"] = floats.layers.block.dense.kernel[:2]
    with pytest.raises(
        tt.StateDictError,
        match=r"'layers\.block\.dense\.kernel': shape mismatch: expected \(3, 4, 4\), got \(2, 4, 4\)",
    ):
        model.load_flat_state_dict(flat, match_quantization=True)
