"""Every layer's sharding annotations: parameters created split as asked (with the values of
an unsharded build, and never whole on one device), and forwards under meshes with Auto and
Explicit axes that equal the unsharded computation and keep the activations' sharding."""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from taktiny import nn
from taktiny.arrays import part
from taktiny.nn import _random

AXES = [AxisType.Auto, AxisType.Explicit]
HEADS = {f"{p}_kernel_sharding": (None, "model") for p in ("query", "key", "value")}
HEADS |= {f"{p}_bias_sharding": ("model",) for p in ("query", "key", "value")}
HEADS |= {"out_kernel_sharding": ("model", None), "out_bias_sharding": (None,)}


def mesh_of(axis_type):
    types = (axis_type, axis_type)
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=types, devices=jax.devices("cpu"))


def data(*shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def padded(spec, ndim):
    return (*spec, *(None,) * (ndim - len(spec)))


class Case(NamedTuple):
    build: object  # (**shardings) -> layer
    shardings: dict  # the annotations
    specs: dict  # flat state name -> the spec each parameter must have
    x: np.ndarray  # the input
    x_spec: P  # how the input is split
    out_spec: tuple  # the output's split under Explicit axes
    forward: object = lambda layer, x: layer(x)


def mha(heads, dropout=0.0):
    return lambda **kw: nn.MultiHeadAttention(
        heads, 8, qkv_features=16, dropout_rate=dropout, rngs=nn.Rngs(0), **kw
    )


def mlp(**kw):
    return nn.Sequential(
        nn.Linear(8, 16, kernel_sharding=kw.get("up"), bias_sharding=("model",), rngs=nn.Rngs(0)),
        jax.nn.relu,
        nn.Linear(16, 8, kernel_sharding=kw.get("down"), bias_sharding=(None,), rngs=nn.Rngs(1)),
    )


MHA_SPECS = {
    f"{p}.{n}": HEADS[f"{p}_{n}_sharding"]
    for p in ("query", "key", "value", "out")
    for n in ("kernel", "bias")
}
IDS = np.array([[0, 3, 5, 17], [1, 2, -1, 15]], np.int32)  # 17: out of range, a NaN row
CASES = {
    "Linear-columns": Case(
        lambda **kw: nn.Linear(8, 16, rngs=nn.Rngs(0), **kw),
        {"kernel_sharding": (None, "model"), "bias_sharding": ("model",)},
        {"kernel": (None, "model"), "bias": ("model",)},
        data(4, 6, 8),
        P("data"),
        ("data", None, "model"),
    ),
    "Linear-rows": Case(  # a contraction over features split on both sides
        lambda **kw: nn.Linear(16, 8, rngs=nn.Rngs(0), **kw),
        {"kernel_sharding": P("model", None), "bias_sharding": P()},
        {"kernel": ("model", None), "bias": (None,)},
        data(4, 6, 16),
        P("data", None, "model"),
        ("data", None, None),
    ),
    "Sequential-mlp": Case(
        mlp,
        {"up": (None, "model"), "down": ("model", None)},
        {
            "layers.0.kernel": (None, "model"),
            "layers.0.bias": ("model",),
            "layers.2.kernel": ("model", None),
            "layers.2.bias": (None,),
        },
        data(4, 6, 8),
        P("data"),
        ("data", None, None),
    ),
    "Embed-vocabulary": Case(
        lambda **kw: nn.Embed(16, 8, rngs=nn.Rngs(0), **kw),
        {"embedding_sharding": ("model", None)},
        {"embedding": ("model", None)},
        IDS,
        P("data"),
        ("data", None, None),
    ),
    "Embed-features": Case(
        lambda **kw: nn.Embed(16, 8, rngs=nn.Rngs(0), **kw),
        {"embedding_sharding": (None, "model")},
        {"embedding": (None, "model")},
        IDS,
        P("data"),
        ("data", None, "model"),
    ),
    "Embed.attend": Case(
        lambda **kw: nn.Embed(16, 8, rngs=nn.Rngs(0), **kw),
        {"embedding_sharding": ("model", None)},
        {"embedding": ("model", None)},
        data(4, 6, 8),
        P("data"),
        ("data", None, "model"),
        lambda layer, x: layer.attend(x),
    ),
    "LayerNorm": Case(  # parameters split, features not: the output keeps x's split
        lambda **kw: nn.LayerNorm(8, **kw),
        {"scale_sharding": ("model",), "bias_sharding": ("model",)},
        {"scale": ("model",), "bias": ("model",)},
        data(4, 6, 8),
        P("data"),
        ("data", None, None),
    ),
    "RMSNorm": Case(
        lambda **kw: nn.RMSNorm(8, **kw),
        {"scale_sharding": ("model",)},
        {"scale": ("model",)},
        data(4, 6, 8),
        P("data", None, "model"),
        ("data", None, "model"),
    ),
    "BatchNorm": Case(
        lambda **kw: nn.BatchNorm(8, **kw),
        {"scale_sharding": ("model",), "bias_sharding": (None,)},
        {"scale": ("model",), "bias": (None,), "mean": ("model",), "var": ("model",)},
        data(4, 6, 8),
        P("data"),
        ("data", None, None),
    ),
    "BatchNorm-train": Case(  # batch statistics split, running ones not: they stay so
        lambda **kw: nn.BatchNorm(8, **kw),
        {"scale_sharding": (None,), "bias_sharding": ("model",)},
        {"scale": (None,), "bias": ("model",), "mean": (None,), "var": (None,)},
        data(4, 6, 8),
        P("data", None, "model"),
        ("data", None, "model"),
        lambda layer, x: nn.train_forward(layer, x),
    ),
    "Conv": Case(  # two batch axes, merged for the convolution and split again
        lambda **kw: nn.Conv(8, 12, (3, 3), strides=2, rngs=nn.Rngs(0), **kw),
        {"kernel_sharding": (None, None, None, "model"), "bias_sharding": ("model",)},
        {"kernel": (None, None, None, "model"), "bias": ("model",)},
        data(2, 2, 5, 6, 8),
        P("data", None, None, None, "model"),
        ("data", None, None, None, "model"),
    ),
    "ConvTranspose": Case(
        lambda **kw: nn.ConvTranspose(8, 12, (3, 3), strides=2, rngs=nn.Rngs(0), **kw),
        {"kernel_sharding": (None, None, None, "model"), "bias_sharding": ("model",)},
        {"kernel": (None, None, None, "model"), "bias": ("model",)},
        data(4, 3, 5, 8),
        P("data"),
        ("data", None, None, "model"),
    ),
    "Conv-bfloat16": Case(  # float32 parameters, computed in bfloat16: cast where they lie
        lambda **kw: nn.Conv(8, 12, 3, dims=2, dtype=jnp.bfloat16, rngs=nn.Rngs(0), **kw),
        {"kernel_sharding": (None, None, None, "model"), "bias_sharding": ("model",)},
        {"kernel": (None, None, None, "model"), "bias": ("model",)},
        data(4, 3, 5, 8),
        P("data"),
        ("data", None, None, "model"),
    ),
    "Embed-bfloat16": Case(
        lambda **kw: nn.Embed(16, 8, dtype=jnp.bfloat16, rngs=nn.Rngs(0), **kw),
        {"embedding_sharding": (None, "model")},
        {"embedding": (None, "model")},
        IDS,
        P("data"),
        ("data", None, "model"),
    ),
    "BatchNorm-train-bfloat16": Case(
        lambda **kw: nn.BatchNorm(8, dtype=jnp.bfloat16, **kw),
        {"scale_sharding": (None,), "bias_sharding": ("model",)},
        {"scale": (None,), "bias": ("model",), "mean": (None,), "var": (None,)},
        data(4, 6, 8),
        P("data", None, "model"),
        ("data", None, "model"),
        lambda layer, x: layer(x, train=True),
    ),
    "MultiHeadAttention": Case(
        mha(4),
        HEADS,
        MHA_SPECS,
        data(4, 6, 8),
        P("data"),
        ("data", None, None),
        lambda layer, x: layer(x, mask=jnp.arange(6) < 5, causal=True),
    ),
    "MultiHeadAttention-dropout": Case(  # 2 heads: too few to split 4 ways
        mha(2, 0.5),
        HEADS,
        MHA_SPECS,
        data(2, 2, 6, 8),
        P("data"),
        ("data", None, None, None),
        lambda layer, x: layer(x, key=jax.random.key(1)),
    ),
}


def nudged(layer):
    """`layer` with every parameter moved by a fixed positive amount, on its own sharding
    (the initial ones and zeros of norms would hide a misplaced scale or bias)."""
    rng = np.random.default_rng(7)
    move = lambda p: (np.asarray(p) + rng.uniform(0.1, 0.6, p.shape)).astype(p.dtype)
    return jax.tree.map(lambda p: jax.device_put(move(p), p.sharding), layer)


@pytest.mark.parametrize("axis_type", AXES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_each_layer_builds_split_as_asked_and_computes_as_unsharded(name, axis_type):
    case, mesh = CASES[name], mesh_of(axis_type)
    reference = case.build()
    with jax.set_mesh(mesh):
        layer = case.build(**case.shardings)
    params, expected = layer.flat_state_dict(), reference.flat_state_dict()
    assert list(params) == list(expected) == list(case.specs)
    for key, param in params.items():
        assert isinstance(param.sharding, NamedSharding) and param.sharding.mesh == mesh, key
        got = padded(param.sharding.spec, param.ndim)
        assert got == padded(case.specs[key], param.ndim), (key, got)
        np.testing.assert_array_equal(np.asarray(param), np.asarray(expected[key]), err_msg=key)

    reference, layer = nudged(reference), nudged(layer)
    want = jax.jit(case.forward)(reference, jnp.asarray(case.x))
    with jax.set_mesh(mesh):
        x = jax.device_put(case.x, case.x_spec)
        got = jax.jit(case.forward)(layer, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    if axis_type == AxisType.Explicit:  # each array's type holds the split chosen for it
        y, *state = jax.tree.leaves(got)  # the output, and BatchNorm's new state
        assert padded(y.sharding.spec, y.ndim) == case.out_spec
        for leaf, key in zip(state, case.specs, strict=False):
            assert padded(leaf.sharding.spec, leaf.ndim) == padded(case.specs[key], leaf.ndim), key


def test_without_a_mesh_annotations_are_ignored():
    for name, case in CASES.items():
        plain, annotated = case.build(), case.build(**case.shardings)
        for key, param in annotated.flat_state_dict().items():
            assert len(param.sharding.device_set) == 1, (name, key)
            np.testing.assert_array_equal(param, plain.flat_state_dict()[key], err_msg=key)


@pytest.mark.parametrize("axis_type", AXES, ids=str)
def test_a_large_parameter_is_never_whole_on_one_device(axis_type):
    mesh, shape, spec = mesh_of(axis_type), (256, 1024), P(None, ("data", "model"))
    with jax.set_mesh(mesh):
        kernel = nn.Linear(*shape, kernel_sharding=spec, rngs=nn.Rngs(0)).kernel
        stddev = math.sqrt(1.0 / shape[0]) / _random._TRUNCATED_STDDEV
        creation = _random._sharded.lower(
            jax.random.key(0), kind="lecun_normal", shape=shape, dtype=np.dtype(np.float32),
            stddev=stddev, explicit=part(spec, mesh, explicit=True),
            auto=part(spec, mesh, explicit=False),
        ).compile()  # fmt: skip
    shards = kernel.addressable_shards
    assert len(shards) == 8 and all(s.data.shape == (256, 128) for s in shards)
    full = math.prod(shape) * 4
    memory = creation.memory_analysis()
    assert memory.output_size_in_bytes == full // 8
    assert memory.temp_size_in_bytes < full  # the whole array is never a temporary
    reference = nn.Linear(*shape, rngs=nn.Rngs(0)).kernel
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(reference))


def test_the_legacy_mesh_context_creates_split_parameters_and_computes():
    mesh, case = mesh_of(AxisType.Auto), CASES["MultiHeadAttention"]
    reference = case.build()
    with pytest.warns(DeprecationWarning), mesh:
        layer = case.build(**case.shardings)
        got = jax.jit(case.forward)(layer, jax.device_put(case.x, NamedSharding(mesh, P("data"))))
    for key, param in layer.flat_state_dict().items():
        assert param.sharding.mesh == mesh, key
        assert padded(param.sharding.spec, param.ndim) == padded(case.specs[key], param.ndim)
    np.testing.assert_array_equal(layer.value.kernel, reference.value.kernel)
    want = case.forward(reference, jnp.asarray(case.x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


MESH = r"on the mesh \{'data': 2, 'model': 4\}: "
BAD = {
    "missing axis": (
        lambda: nn.Conv(
            8, 12, (3, 3), kernel_sharding=(None, None, None, "tensor"), rngs=nn.Rngs(0)
        ),
        r"Conv\.kernel of shape \(3, 3, 8, 12\) cannot be placed by "
        r"P\(None, None, None, 'tensor'\) " + MESH + r"the mesh has no axis 'tensor'",
    ),
    "not divisible": (
        lambda: nn.MultiHeadAttention(2, 6, key_kernel_sharding=(None, "model"), rngs=nn.Rngs(0)),
        r"MultiHeadAttention\.key\.kernel of shape \(6, 6\) cannot be placed by "
        r"P\(None, 'model'\) " + MESH + r"axis 1 of size 6 does not divide into 4 parts",
    ),
    "too many entries": (
        lambda: nn.LayerNorm(8, bias_sharding=("model", None)),
        r"LayerNorm\.bias of shape \(8,\) cannot be placed by P\('model', None\) "
        + MESH
        + r"the spec has 2 entries, the array 1 axes",
    ),
    "out bias": (
        lambda: nn.MultiHeadAttention(2, 6, out_bias_sharding=("model",), rngs=nn.Rngs(0)),
        r"MultiHeadAttention\.out\.bias of shape \(6,\) cannot be placed by P\('model',\) "
        + MESH
        + r"axis 0 of size 6 does not divide into 4 parts",
    ),
    "batchnorm": (
        lambda: nn.BatchNorm(6, scale_sharding=("model",)),
        r"BatchNorm\.scale of shape \(6,\) cannot be placed by P\('model',\) " + MESH,
    ),
    "transpose": (
        lambda: nn.ConvTranspose(8, 6, (3,), bias_sharding=("data", "model"), rngs=nn.Rngs(0)),
        r"ConvTranspose\.bias of shape \(6,\) cannot be placed by P\('data', 'model'\) " + MESH,
    ),
    # both problems: the entries after one that names no mesh axis are checked too
    "two problems": (
        lambda: nn.Linear(8, 6, kernel_sharding=("modle", ("data", "model")), rngs=nn.Rngs(0)),
        r"Linear\.kernel of shape \(8, 6\) cannot be placed by P\('modle', \('data', 'model'\)\) "
        + MESH
        + r"the mesh has no axis 'modle' \(its axes: 'data', 'model'\); axis 1 of size 6 does "
        r"not divide into 8 parts \(mesh axes 'data', 'model'\)\. Change the sharding, or the "
        r"mesh\.$",
    ),
}


@pytest.mark.parametrize("axis_type", AXES, ids=str)
@pytest.mark.parametrize("problem", list(BAD))
def test_a_spec_that_cannot_place_a_parameter_names_it_its_shape_the_spec_and_mesh(
    problem, axis_type
):
    build, message = BAD[problem]
    with jax.set_mesh(mesh_of(axis_type)), pytest.raises(ValueError, match=message):
        build()


def test_a_mesh_of_mixed_axis_types_places_both_kinds_of_axis():
    devices = jax.devices("cpu")
    mesh = jax.make_mesh(
        (2, 4), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto), devices=devices
    )
    reference = nn.Linear(16, 32, rngs=nn.Rngs(0)).kernel
    for spec in [("data", "model"), (("data", "model"), None), (None, "model")]:
        with jax.set_mesh(mesh):
            kernel = nn.Linear(16, 32, kernel_sharding=spec, rngs=nn.Rngs(0)).kernel
        assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec)), 2), spec
        np.testing.assert_array_equal(np.asarray(kernel), np.asarray(reference))


@pytest.mark.parametrize("axis_type", AXES, ids=str)
def test_a_list_of_mesh_axes_splits_one_axis_as_their_tuple(axis_type):
    """(None, ["data", "model"]), as a configuration file gives it: axis 1 split 8 ways."""
    mesh = mesh_of(axis_type)
    with jax.set_mesh(mesh):
        kernel = nn.Linear(
            16, 32, kernel_sharding=(None, ["data", "model"]), rngs=nn.Rngs(0)
        ).kernel
    assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, P(None, ("data", "model"))), 2)
    assert [s.data.shape for s in kernel.addressable_shards] == [(16, 4)] * 8
    np.testing.assert_array_equal(kernel, nn.Linear(16, 32, rngs=nn.Rngs(0)).kernel)
