"""Loads across representations: a float state into a quantized model (quantized on load
with match_quantization=True), a quantized state into a float model (dequantized), a QArray
quantized another way (re-quantized); nested and flat, abstract and sharded targets; and
the errors without the option, or for values that cannot be converted."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import taktiny as tt
from taktiny import nn
from taktiny.quant import _qarray as _quant
from taktiny.state import _state

MATCH = {"match_quantization": True}


@pytest.fixture(autouse=True, params=["walk", "flat"])
def view(request, monkeypatch):
    """Every test runs twice: loads that walk to the leaves they name, and loads that
    flatten the model."""
    monkeypatch.setattr(_state, "WALK_LIMIT", 10**9 if request.param == "walk" else -1)
    return request.param


class Net(nn.Module):
    def __init__(self, *, param_dtype=jnp.float32, rngs):
        self.embed = nn.Embed(50, 32, param_dtype=param_dtype, rngs=rngs)
        self.encoder = [nn.Linear(32, 64, param_dtype=param_dtype, rngs=rngs),
                        nn.Linear(64, 32, param_dtype=param_dtype, rngs=rngs)]  # fmt: skip
        self.head = nn.Linear(32, 8, param_dtype=param_dtype, rngs=rngs)


def quantized(model, **kw):
    """`model` quantized in int4 groups of 16, its head left in float."""
    return tt.quantize(model, bits=4, group_size=16, where=lambda name, _: name != "head", **kw)


def bitwise_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb, strict=True)
    )


def quantized_leaves(tree):
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tt.QArray))


# --- a float state into a quantized model -----------------------------------------------------


def test_a_float_state_quantizes_on_load_like_the_models_leaves():
    source = Net(rngs=nn.Rngs(0))
    model = quantized(Net(rngs=nn.Rngs(1)))
    expected = quantized(source)  # what quantizing the float model gives
    loads = [
        model.load_state_dict(source.state_dict(), **MATCH),
        model.load_state_dict(source.state_dict(), strict=True, **MATCH),
        model.load_flat_state_dict(source.flat_state_dict(), **MATCH),
        model.load_flat_state_dict(source.flat_state_dict(), strict=True, **MATCH),
        tt.load_state_dict(model, source.state_dict(), **MATCH),
        tt.load_flat_state_dict(model, source.flat_state_dict(), **MATCH),
    ]
    for loaded in loads:
        assert jax.tree.structure(loaded) == jax.tree.structure(model)
        assert bitwise_equal(loaded, expected)
        assert loaded.encoder[0].bias is source.encoder[0].bias  # ordinary leaves as they are


def test_only_the_parameters_named_are_quantized():
    source, model = Net(rngs=nn.Rngs(0)), quantized(Net(rngs=nn.Rngs(1)))
    kernel = np.asarray(source.encoder[1].kernel)
    nested = model.load_state_dict({"encoder": {"1": {"kernel": kernel}}}, **MATCH)
    flat = model.load_flat_state_dict({"encoder.1.kernel": kernel}, **MATCH)
    for loaded in (nested, flat):
        like = _quant.quantize_like(kernel, model.encoder[1].kernel)
        assert bitwise_equal(loaded.encoder[1].kernel, like)
        assert loaded.encoder[0].kernel.value is model.encoder[0].kernel.value
        assert loaded.embed.embedding.scale is model.embed.embedding.scale


def test_quantizing_on_load_keeps_the_layout_and_scale_dtype_of_each_leaf():
    source = Net(rngs=nn.Rngs(0))
    model = tt.quantize(Net(param_dtype=jnp.bfloat16, rngs=nn.Rngs(1)), bits=8, where="encoder.**")
    loaded = model.load_state_dict(source.state_dict(), **MATCH)
    kernel = loaded.encoder[1].kernel
    assert (kernel.bits, kernel.axis, kernel.group_size) == (8, 0, None)
    assert kernel.scale.dtype == jnp.bfloat16 and kernel.value.dtype == jnp.int8
    assert loaded.head.kernel.dtype == jnp.bfloat16  # a float leaf: cast as always
    w = source.encoder[1].kernel  # quantized from float32, not rounded to bfloat16 first
    assert bitwise_equal(kernel, _quant.quantize_like(w, model.encoder[1].kernel))


def test_a_quantized_model_refuses_a_float_state_without_the_option():
    source, model = Net(rngs=nn.Rngs(0)), quantized(Net(rngs=nn.Rngs(1)))
    message = (
        r"'encoder\.0\.kernel': the model holds a quantized array here, QArray\(i4\[32,64\], "
        r"scale=f32\[2,64\], axis=0, group_size=16\), and the state an array float32\[32, 64\]: "
        r"the representations differ\. Pass match_quantization=True to quantize it on load as "
        r"the model's is, or load it into the float model and quantize that \(tt\.quantize\)\."
    )
    with pytest.raises(tt.StateDictError, match=message) as nested:
        model.load_state_dict(source.state_dict())
    with pytest.raises(tt.StateDictError, match=message) as flat:
        model.load_flat_state_dict(source.flat_state_dict())
    for error in (nested, flat):
        problems = [(p.name, p.kind) for p in error.value.problems]
        assert problems == [("embed.embedding", "representation"),
                            ("encoder.0.kernel", "representation"),
                            ("encoder.1.kernel", "representation")]  # fmt: skip
        assert str(error.value).startswith("Net.load_")
    # strict: the names given in another representation are not also missing
    with pytest.raises(tt.StateDictError, match=r"3 problems; nothing was loaded") as strict:
        model.load_flat_state_dict(source.flat_state_dict(), strict=True)
    assert {p.kind for p in strict.value.problems} == {"representation"}


def test_a_float_value_that_cannot_be_quantized_is_refused_before_anything_is_computed(
    monkeypatch,
):
    source, model = Net(rngs=nn.Rngs(0)), quantized(Net(rngs=nn.Rngs(1)))
    calls = []
    monkeypatch.setattr(_quant, "_quantize", lambda *a, **k: calls.append(a))
    with pytest.raises(
        tt.StateDictError,
        match=r"2 problems; nothing was loaded\.\n"
        r"  - 'encoder\.0\.kernel': shape mismatch: expected \(32, 64\), got \(64, 32\)\.\n"
        r"  - 'encoder\.1\.kernel': cannot quantize an array int32\[64, 32\] on load as the "
        r"model's QArray\(i4\[64,32\], scale=f32\[4,32\], axis=0, group_size=16\) is: "
        r"quantizing takes a float array\.",
    ):
        model.load_state_dict(
            {"encoder": {"0": {"kernel": np.zeros((64, 32), np.float32)},
                         "1": {"kernel": np.zeros((64, 32), np.int32)}},
             "embed": source.state_dict()["embed"]},
            **MATCH,
        )  # fmt: skip
    assert calls == []  # the good one was not quantized either: nothing is, when one fails
    # a problem elsewhere in the same load stops the quantizing too, and is listed with it
    with pytest.raises(tt.StateDictError, match=r"'head\.bias': shape mismatch"):
        model.load_state_dict({**source.state_dict(), "head": {"bias": np.zeros(3)}}, **MATCH)
    assert calls == []


def test_an_abstract_quantized_model_loads_a_float_state():
    source = Net(rngs=nn.Rngs(0))
    abstract = jax.eval_shape(lambda: quantized(Net(rngs=nn.Rngs(1))))
    assert isinstance(abstract.encoder[0].kernel.value, jax.ShapeDtypeStruct)
    loaded = abstract.load_state_dict(source.state_dict(), **MATCH)
    assert bitwise_equal(loaded, quantized(source))
    loaded = abstract.load_flat_state_dict(source.flat_state_dict(), strict=True, **MATCH)
    assert bitwise_equal(loaded, quantized(source))
    with pytest.raises(
        tt.StateDictError, match=r"'head\.kernel': not supplied, and the model is abstract"
    ):
        abstract.load_state_dict({"encoder": source.state_dict()["encoder"]}, **MATCH)


def mesh_of(axis_type):
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2,
                         devices=jax.devices("cpu"))  # fmt: skip


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_quantizing_on_load_keeps_the_models_shardings(axis_type, monkeypatch):
    def build():
        return nn.QuantizedLinear(64, 32, bits=4, group_size=16, kernel_sharding=(None, "model"),
                                  bias_sharding=("model",), rngs=nn.Rngs(1))  # fmt: skip

    with jax.set_mesh(mesh_of(axis_type)):
        model = build()
        abstract = tt.eval_shape(build)
    float_state = nn.Linear(64, 32, rngs=nn.Rngs(0)).state_dict()  # on one device
    expected = _quant.quantize_like(float_state["kernel"], model.kernel)
    seen = []  # the float arrays quantized: on the devices of the model's value, split alike
    quantize_array = _quant.quantize_array
    spy = lambda a, **kw: (seen.append(a.sharding), quantize_array(a, **kw))[1]
    monkeypatch.setattr(_quant, "quantize_array", spy)
    for target in (model, abstract):
        loaded = target.load_state_dict(float_state, **MATCH)
        for part in ("value", "scale"):
            have = getattr(loaded.kernel, part).sharding
            assert have.is_equivalent_to(getattr(model.kernel, part).sharding, 2)
        assert loaded.bias.sharding.is_equivalent_to(model.bias.sharding, 1)
        assert seen.pop() == model.kernel.value.sharding
        assert bitwise_equal(loaded.kernel, expected)


def test_converting_on_load_works_inside_jit():
    source, model = nn.Linear(64, 8, rngs=nn.Rngs(0)), nn.QuantizedLinear(64, 8, rngs=nn.Rngs(1))
    loaded = jax.jit(lambda m, s: m.load_state_dict(s, **MATCH))(model, source.state_dict())
    assert bitwise_equal(loaded, tt.quantize(source))
    back = jax.jit(lambda m, s: m.load_flat_state_dict(s, **MATCH))(source, model.flat_state_dict())
    assert bitwise_equal(back.kernel, model.kernel.dequantize())


def test_a_qarray_of_numpy_parts_quantizes_a_float_state_on_load():
    like = tt.QArray(np.ones((32, 8), np.int8), np.ones((2, 8), np.float32), bits=8, axis=0,
                     group_size=16)  # fmt: skip
    w = np.random.default_rng(0).normal(size=(32, 8)).astype(np.float32)
    loaded = tt.load_state_dict({"w": like}, {"w": w}, **MATCH)["w"]
    assert bitwise_equal(loaded, _quant.quantize_like(w, like))


def test_a_tensor_of_another_framework_is_quantized_on_load():
    class Tensor:  # an array of another framework: only DLPack
        def __init__(self, array):
            self.array = array

        def __dlpack__(self, **kw):
            return self.array.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.array.__dlpack_device__()

    model = nn.QuantizedLinear(64, 8, rngs=nn.Rngs(1))
    kernel = np.array(nn.Linear(64, 8, rngs=nn.Rngs(0)).kernel)  # writable: DLPack exports it
    loaded = model.load_state_dict({"kernel": Tensor(kernel)}, **MATCH)
    assert bitwise_equal(loaded.kernel, _quant.quantize_like(kernel, model.kernel))
    with pytest.raises(
        tt.StateDictError,
        match=r"^QuantizedLinear\.load_state_dict\(\): 1 problem; nothing was loaded\.\n  - 'kernel': the "
        r"model holds a quantized array here, QArray\(i8\[64,8\], scale=f32\[1,8\], axis=0\), "
        r"and the state a value of type Tensor: the representations differ\. Pass",
    ):
        model.load_state_dict({"kernel": Tensor(kernel)})


def test_a_group_that_would_straddle_devices_is_refused_by_the_parameters_name():
    mesh = mesh_of(AxisType.Auto)
    value = jax.device_put(jnp.zeros((32, 8), jnp.int8), NamedSharding(mesh, P("model", None)))
    scale = jax.device_put(jnp.ones((2, 8), jnp.float32), NamedSharding(mesh, P()))
    model = {"dense": {"kernel": tt.QArray(value, scale, bits=8, axis=0, group_size=16)}}
    with pytest.raises(
        ValueError,
        match=r"^dense\.kernel of shape \(32, 8\) is split 4 ways along axis 0 \(P\('model', "
        r"None\) on the mesh \{'data': 2, 'model': 4\}\), which does not divide its 2 groups",
    ):
        tt.load_state_dict(model, {"dense": {"kernel": np.ones((32, 8), np.float32)}}, **MATCH)


# --- a quantized state into a float model -----------------------------------------------------


def quantized_states(q):
    """A quantized model's state in each form a loader may see, and whether it is flat."""
    kernel = q.encoder[0].kernel
    return [
        (q.state_dict(), False),  # QArrays whole
        (q.flat_state_dict(), True),  # their parts by name
        ({"encoder": {"0": {"kernel": {"value": kernel.value, "scale": kernel.scale}}}},
         False),  # the parts as a dict, as Orbax restores them without a target
        ({"encoder.0.kernel": kernel}, True),  # a QArray whole under a flat name
    ]  # fmt: skip


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_quantized_state_dequantizes_on_load_into_the_float_leaves(dtype):
    q = quantized(Net(rngs=nn.Rngs(0)))
    model = Net(param_dtype=dtype, rngs=nn.Rngs(1))
    for state, flat in quantized_states(q):
        load = model.load_flat_state_dict if flat else model.load_state_dict
        loaded = load(state, **MATCH)
        assert jax.tree.structure(loaded) == jax.tree.structure(model)
        kernel = loaded.encoder[0].kernel
        assert isinstance(kernel, jax.Array) and kernel.dtype == dtype
        assert bitwise_equal(kernel, q.encoder[0].kernel.dequantize(dtype))
    loaded = model.load_state_dict(q.state_dict(), strict=True, **MATCH)
    if dtype == jnp.float32:
        assert bitwise_equal(loaded, tt.dequantize(q))
    assert bitwise_equal(loaded.embed.embedding, q.embed.embedding.dequantize(dtype))
    assert loaded.head.kernel.dtype == dtype


def test_a_float_model_refuses_a_quantized_state_without_the_option():
    q = quantized(Net(rngs=nn.Rngs(0)))
    model = Net(rngs=nn.Rngs(1))
    whole = (
        r"'encoder\.0\.kernel': the model holds an array float32\[32, 64\] here and the state a "
        r"QArray\(i4\[32,64\], scale=f32\[2,64\], axis=0, group_size=16\): the representations "
        r"differ\. Pass match_quantization=True to dequantize it on load, or quantize the model "
        r"first to keep it quantized \(tt\.quantize\(model, bits=4, group_size=16\)\)\."
    )
    parts = (
        r"'encoder\.0\.kernel': the model holds an array float32\[32, 64\] here and the state "
        r"the parts of a quantized array \(value int4\[32, 64\], scale float32\[2, 64\]\): the "
        r"representations differ\. Pass match_quantization=True to dequantize it on load"
    )
    named = (  # flat parts are names inside a float array, each told how to dequantize
        r"'encoder\.0\.kernel' is an array, so it has no entry 'value'; give the array itself "
        r"at 'encoder\.0\.kernel', or pass match_quantization=True to dequantize a quantized "
        r"array's parts on load\."
    )
    cases = [(whole, "representation"), (named, "structure"), (parts, "representation"),
             (whole, "representation")]  # fmt: skip
    for (state, flat), (message, kind) in zip(quantized_states(q), cases, strict=True):
        load = model.load_flat_state_dict if flat else model.load_state_dict
        with pytest.raises(tt.StateDictError, match=message) as error:
            load(state)
        assert {p.kind for p in error.value.problems} == {kind}


def test_parts_that_make_no_quantized_array_are_refused():
    q = quantized(Net(rngs=nn.Rngs(0)))
    model = Net(rngs=nn.Rngs(1))
    value, scale = q.encoder[0].kernel.value, q.encoder[0].kernel.scale
    cases = [
        ({"encoder.0.kernel.value": value},
         r"'encoder\.0\.kernel': cannot dequantize the parts of a quantized array \(value "
         r"int4\[32, 64\]\): both the value and the scale are needed, got no scale\."),
        ({"encoder.0.kernel.value": value, "encoder.0.kernel.scale": np.ones((3, 64), np.float32)},
         r"cannot dequantize .*: a scale of shape \(3, 64\) does not fit a value of shape "
         r"\(32, 64\): it must be the value's shape with one axis reduced to 1 \(one scale per "
         r"channel\) or to a number of groups that divides it\."),
        ({"encoder.0.kernel.value": np.zeros((32, 64), np.int32), "encoder.0.kernel.scale": scale},
         r"cannot dequantize .*: the value must be int8 or int4, got int32\."),
        ({"encoder.0.kernel.value": value, "encoder.0.kernel.scale": np.ones((2, 64), np.int32)},
         r"cannot dequantize .*: scale must be a float array, got int32\."),
    ]  # fmt: skip
    for state, message in cases:
        with pytest.raises(tt.StateDictError, match=message):
            model.load_flat_state_dict(state, **MATCH)
    with pytest.raises(
        tt.StateDictError,
        match=r"'encoder\.0\.kernel': shape mismatch: expected \(32, 64\), got "
        r"\(64, 32\)\.",
    ):
        model.load_state_dict({"encoder": {"0": {"kernel": tt.QArray.quantize(value.T.astype(
            jnp.float32))}}}, **MATCH)  # fmt: skip
    # an integer leaf is no float one to dequantize into
    counter = {"step": jnp.zeros((32, 64), jnp.int32)}
    with pytest.raises(
        tt.StateDictError,
        match=r"'step': dtype kind changes: the model holds int32 \(signed integer\), got float32",
    ):
        tt.load_state_dict(counter, {"step": q.encoder[0].kernel}, **MATCH)
    # without the option, parts that make no QArray are told as before
    with pytest.raises(
        tt.StateDictError,
        match=r"'encoder\.0\.kernel' is an array, so it has no entry 'scale'; give the array",
    ):
        model.load_flat_state_dict({"encoder.0.kernel.scale": np.ones(3)})


def test_a_qarray_where_a_python_number_belongs_is_told_by_its_shape():
    with pytest.raises(
        tt.StateDictError,
        match=r"^taktiny\.load_state_dict\(dict\): 1 problem; nothing was loaded\.\n  - 'x': "
        r"shape mismatch: expected \(\), got \(4, 6\)\.$",
    ):
        tt.load_state_dict({"x": 1.0}, {"x": tt.QArray.quantize(jnp.ones((4, 6)))}, **MATCH)


def test_dequantizing_on_load_keeps_the_float_models_shardings():
    mesh = mesh_of(AxisType.Explicit)
    with jax.set_mesh(mesh):
        model = nn.Linear(64, 32, kernel_sharding=("model", None), rngs=nn.Rngs(1))
        q = nn.QuantizedLinear(64, 32, kernel_sharding=(None, "model"), rngs=nn.Rngs(0))
    loaded = model.load_state_dict(q.state_dict(), **MATCH)
    assert loaded.kernel.sharding.is_equivalent_to(NamedSharding(mesh, P("model", None)), 2)
    np.testing.assert_array_equal(loaded.kernel, q.kernel.dequantize())


# --- a quantized state into a model quantized another way -------------------------------------


def test_a_qarray_quantized_another_way_is_requantized_on_load():
    source = Net(rngs=nn.Rngs(0))
    int8 = tt.quantize(source)
    model = quantized(Net(rngs=nn.Rngs(1)))
    loaded = model.load_state_dict(int8.state_dict(), **MATCH)
    for have, given, like in zip(quantized_leaves(loaded), quantized_leaves(int8),
                                 quantized_leaves(model), strict=True):  # fmt: skip
        if isinstance(like, tt.QArray):
            assert bitwise_equal(have, _quant.quantize_like(given.dequantize(jnp.float32), like))
    with pytest.raises(
        tt.StateDictError,
        match=r"'encoder\.1\.kernel': the model holds QArray\(i4\[64,32\], scale=f32\[4,32\], "
        r"axis=0, group_size=16\) here and the state QArray\(i8\[64,32\], scale=f32\[1,32\], "
        r"axis=0\): quantized another way\. Pass match_quantization=True to re-quantize it on "
        r"load as the model's is \(dequantized, then rounded again\), or load it into a model "
        r"quantized as the state is \(tt\.quantize\(model, bits=8\)\)\.",
    ):
        model.load_state_dict(int8.state_dict())


def test_a_qarray_with_a_narrower_scale_is_requantized_from_float32():
    source = Net(param_dtype=jnp.bfloat16, rngs=nn.Rngs(0))
    int8 = tt.quantize(source)  # bfloat16 scales
    model = quantized(Net(rngs=nn.Rngs(1)))
    given, like = int8.encoder[1].kernel, model.encoder[1].kernel
    assert given.scale.dtype == jnp.bfloat16
    loaded = model.load_state_dict({"encoder": {"1": {"kernel": given}}}, **MATCH)
    expected = _quant.quantize_like(given.dequantize(jnp.float32), like)
    rounded = _quant.quantize_like(given.dequantize(), like)  # dequantized to bfloat16 first
    assert not bitwise_equal(expected, rounded)  # the two differ: the test can tell them
    assert bitwise_equal(loaded.encoder[1].kernel, expected)


def test_an_int8_value_where_int4_is_expected_is_refused_even_with_the_option():
    int8 = tt.quantize(Net(rngs=nn.Rngs(0)))
    model = quantized(Net(rngs=nn.Rngs(1)))
    kernel = int8.encoder[0].kernel
    message = (
        r"'encoder\.0\.kernel\.value': the value of 'encoder\.0\.kernel', QArray\(i4\[32,64\], "
        r"scale=f32\[2,64\], axis=0, group_size=16\), holds int4 \(a 4-bit quantization\); got "
        r"int8, the integers of another one \(8-bit\), which a cast would not re-scale\. A "
        r"checkpoint quantized another way loads whole, as tt\.QArray\(value, scale, bits=\.\.\., "
        r"axis=\.\.\., group_size=\.\.\.\), with match_quantization=True"
    )
    small = jnp.zeros((32, 64), jnp.int8)  # in int4's range: still another bit width
    for options in ({}, MATCH):
        for value in (kernel.value, small):
            with pytest.raises(tt.StateDictError, match=message):
                model.load_flat_state_dict({"encoder.0.kernel.value": value}, **options)
            with pytest.raises(tt.StateDictError, match=message):
                model.load_state_dict({"encoder": {"0": {"kernel": {"value": value}}}}, **options)
    # and the reverse: int4 values are not widened into an 8-bit QArray
    with pytest.raises(
        tt.StateDictError,
        match=r"'encoder\.0\.kernel\.value': the value of 'encoder\.0\.kernel', QArray\(i8\[32,64\]"
        r".*holds int8 \(an 8-bit quantization\); got int4, the integers of another one \(4-bit\)",
    ):
        int8.load_flat_state_dict({"encoder.0.kernel.value": model.encoder[0].kernel.value})
    # a plain int4 leaf takes no other integers either
    with pytest.raises(
        tt.StateDictError,
        match=r"'x': the model holds int4 here and the state int8: integers of another width, as "
        r"quantized values of another number of bits are, which a cast would not re-scale\. Cast "
        r"the value yourself \(value\.astype\(jnp\.int4\)\) if it really holds int4 values\.",
    ):
        tt.load_state_dict({"x": jnp.zeros(3, jnp.int4)}, {"x": np.zeros(3, np.int8)})


def test_a_value_and_scale_of_mismatched_shapes_are_refused():
    model = quantized(Net(rngs=nn.Rngs(1)))
    kernel = model.encoder[0].kernel
    scale = np.ones((1, 64), np.float32)  # one per channel, where the model has groups of 16
    message = (
        r"'encoder\.0\.kernel\.scale': the scale of 'encoder\.0\.kernel', QArray\(i4\[32,64\], "
        r"scale=f32\[2,64\], axis=0, group_size=16\), has shape \(2, 64\) \(one per group of 16 "
        r"along axis 0\), got \(1, 64\): the scales of another layout\."
    )
    for options in ({}, MATCH):
        with pytest.raises(tt.StateDictError, match=message):
            model.load_state_dict(
                {"encoder": {"0": {"kernel": {"value": kernel.value, "scale": scale}}}}, **options
            )
        with pytest.raises(tt.StateDictError, match=message):
            model.load_flat_state_dict(
                {"encoder.0.kernel.value": kernel.value, "encoder.0.kernel.scale": scale},
                **options,
            )
    with pytest.raises(
        tt.StateDictError,
        match=r"'encoder\.0\.kernel\.value': shape mismatch: expected \(32, 64\), got \(64, 32\)\. "
        r"\(It is the value of 'encoder\.0\.kernel', QArray\(i4\[32,64\]",
    ):
        model.load_flat_state_dict({"encoder.0.kernel.value": jnp.zeros((64, 32), jnp.int4)})
    with pytest.raises(ValueError, match=r"QArray: scale has shape \(1, 64\), expected \(2, 64\)"):
        tt.QArray(kernel.value, jnp.asarray(scale), bits=4, axis=0, group_size=16)


def test_a_failed_load_changes_nothing():
    model = quantized(Net(rngs=nn.Rngs(1)))
    before = jax.tree.leaves(model)
    state = {**Net(rngs=nn.Rngs(0)).state_dict(), "encoder": {"0": {"kernal": np.ones(3)}}}
    with pytest.raises(tt.StateDictError, match=r"unknown key; did you mean 'encoder\.0\.kernel'"):
        model.load_state_dict(state, **MATCH)
    assert all(a is b for a, b in zip(jax.tree.leaves(model), before, strict=True))


def test_neither_part_of_a_qarray_is_trainable():
    model = nn.QuantizedLinear(8, 4, rngs=nn.Rngs(0))
    flags = tt.trainable(model)
    assert flags.kernel.value is False and flags.kernel.scale is False and flags.bias is True
    assert jax.tree.structure(flags) == jax.tree.structure(model)
    # a tree with holes (None where the integers were: eqx.filter, or the gradients of
    # eqx.filter_grad, on which optax calls its labels function) gets the same holes
    floats = eqx.filter(model, eqx.is_inexact_array)
    flags = tt.trainable(floats)
    assert jax.tree.structure(flags) == jax.tree.structure(floats)
    assert flags.kernel.value is None and flags.kernel.scale is False and flags.bias is True
