"""nn.Module: field rules, freezing, PyTree registration, transformations, repr, replace."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import MLP

import taktiny as tt
from taktiny import nn


class Declared(nn.Module):
    weight: jax.Array
    scale: float = 2.0
    tag: str = "t"
    extra: list = nn.field(default_factory=list)


def test_undeclared_fields_sort_into_data_and_static():
    class M(nn.Module):
        def __init__(self):
            self.w = jnp.ones(3)
            self.n = 3
            self.name = "m"
            self.act = jax.nn.relu
            self.dt = jnp.float32
            self.sub = [nn.Linear(2, 2, rngs=nn.Rngs(0)), None]
            self.cfg = {"depth": 2}
            self.nothing = None

    m = M()
    leaves = jax.tree.leaves(m)
    assert len(leaves) == 3  # w, sub[0].kernel, sub[0].bias
    treedef = jax.tree.structure(m)
    # static values live in the tree structure, not among the leaves
    assert all(isinstance(leaf, jax.Array) for leaf in leaves)
    assert "'m'" in str(treedef) and "depth" in str(treedef)
    assert type(m)._taktiny_layout == (
        ("w", True),
        ("n", False),
        ("name", False),
        ("act", False),
        ("dt", False),
        ("sub", True),
        ("cfg", False),
        ("nothing", True),
    )


def test_declared_fields_generate_init_with_defaults():
    d = Declared(jnp.ones(2))
    assert d.scale == 2.0 and d.tag == "t" and d.extra == []
    assert Declared(jnp.ones(2)).extra is not d.extra  # default_factory called per instance
    d2 = Declared(weight=jnp.zeros(2), scale=3.0)
    assert d2.scale == 3.0
    assert jax.tree.leaves(d2)[0].shape == (2,)
    with pytest.raises(TypeError, match="missing a required argument: 'weight'"):
        Declared()


def test_declared_field_can_force_either_side():
    class M(nn.Module):
        count: int = nn.field(static=False)
        table: tuple = nn.field(static=True)

    m = M(count=3, table=(1, 2))
    assert jax.tree.leaves(m) == [3]
    with pytest.raises(TypeError, match=r"M\.table is declared static but holds an array"):
        M(count=1, table=(jnp.ones(2),))


def test_custom_init_must_set_declared_fields():
    class M(nn.Module):
        w: jax.Array

        def __init__(self):
            pass

    with pytest.raises(TypeError, match=r"M\.__init__ did not set the declared field 'w'"):
        M()


def test_post_init_runs_for_generated_init():
    class M(nn.Module):
        w: jax.Array

        def __post_init__(self):
            self.double = self.w * 2

    m = M(jnp.ones(2))
    np.testing.assert_array_equal(m.double, [2.0, 2.0])


def test_frozen_after_init_with_helpful_error():
    m = MLP(rngs=nn.Rngs(0))
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"module = module\.replace\(input="):
        m.input = None
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"eqx\.tree_at"):
        m.input = None
    with pytest.raises(dataclasses.FrozenInstanceError, match="immutable"):
        del m.output


def test_replace_returns_a_checked_copy():
    m = MLP(rngs=nn.Rngs(0))
    other = nn.Linear(32, 64, rngs=nn.Rngs(1))
    m2 = m.replace(input=other)
    assert m2.input is other and m.input is not other and m2.output is m.output
    with pytest.raises(TypeError, match=r"unknown field\(s\) \['inputs'\]"):
        m.replace(inputs=other)
    with pytest.raises(TypeError, match=r"Lambda\(fn\)"):
        m.replace(input=[other, "not-an-array"])


def test_mixed_container_and_bad_dict_keys_are_errors():
    class M(nn.Module):
        def __init__(self, value):
            self.value = value

    with pytest.raises(TypeError, match=r"M\.value\[1\] is 'relu'"):
        M([jnp.ones(2), "relu"])
    with pytest.raises(TypeError, match=r"has the dict key 'a\.b'.*'a_b'"):
        M({"a.b": jnp.ones(2)})
    with pytest.raises(TypeError, match=r"has the dict key 3"):
        M({3: jnp.ones(2)})


def test_rngs_cannot_be_stored():
    class M(nn.Module):
        def __init__(self, rngs):
            self.rngs = rngs

    with pytest.raises(TypeError, match=r"M\.rngs holds an nn\.Rngs"):
        M(nn.Rngs(0))


def test_a_second_layout_gets_its_own_node_type_with_the_same_name():
    class M(nn.Module):
        def __init__(self, flag):
            self.x = jnp.ones(2) if flag else "none"

    a, b = M(True), M(False)
    assert isinstance(b, M) and type(b).__name__ == "M"
    assert jax.tree.leaves(a)[0].shape == (2,) and jax.tree.leaves(b) == []
    assert repr(b) == "M(x='none')"
    assert jax.tree.map(lambda x: x + 1, a).x[0] == 2


def test_key_paths_name_leaves_by_attribute():
    m = nn.Sequential(MLP(rngs=nn.Rngs(0)))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(m)[0]]
    assert paths == [
        ".layers[0].input.kernel",
        ".layers[0].input.bias",
        ".layers[0].output.kernel",
        ".layers[0].output.bias",
    ]


def test_repr_is_readable():
    assert repr(nn.Linear(32, 64, rngs=nn.Rngs(0))) == "Linear(kernel=f32[32,64], bias=f32[64])"
    assert repr(MLP(rngs=nn.Rngs(0))) == (
        "MLP(\n  input=Linear(kernel=f32[32,64], bias=f32[64]),\n"
        "  output=Linear(kernel=f32[64,4], bias=f32[4])\n)"
    )
    assert repr(Declared(jnp.ones(2), tag="x")) == "Declared(weight=f32[2], tag='x', extra=[])"
    # fields keep their declared order whichever were passed
    assert type(Declared(jnp.ones(2), tag="x")) is type(Declared(jnp.ones(2)))


def test_works_with_jax_transformations():
    m = MLP(rngs=nn.Rngs(0))
    x = jnp.ones((5, 32))
    np.testing.assert_allclose(jax.jit(lambda m, x: m(x))(m, x), m(x), rtol=1e-6)
    grads = jax.grad(lambda m: jnp.sum(m(x)))(m)
    assert isinstance(grads, MLP) and grads.input.kernel.shape == (32, 64)
    batched = jax.vmap(lambda m, x: m(x), in_axes=(None, 0))(m, jnp.ones((3, 5, 32)))
    assert batched.shape == (3, 5, 4)
    abstract = jax.eval_shape(lambda: MLP(rngs=nn.Rngs(0)))
    assert isinstance(abstract.input.kernel, jax.ShapeDtypeStruct)
    assert eqx.filter_jit(lambda m, x: m(x))(m, x).shape == (5, 4)
    zeroed = eqx.tree_at(lambda m: m.output.bias, m, jnp.zeros(4))
    assert zeroed.output.bias is not m.output.bias
    assert zeroed.input.kernel is m.input.kernel


def test_optax_updates_a_module(optax_promotion):
    m = MLP(rngs=nn.Rngs(0))
    opt = optax.adam(1e-2)
    opt_state = opt.init(m)
    grads = jax.grad(lambda m: jnp.sum(m(jnp.ones((2, 32)))))(m)
    updates, _ = opt.update(grads, opt_state, m)
    new = optax.apply_updates(m, updates)
    assert isinstance(new, MLP)
    assert not np.allclose(new.input.kernel, m.input.kernel)


def test_rngs_same_seed_same_parameters():
    a, b = MLP(rngs=nn.Rngs(0)), MLP(rngs=nn.Rngs(0))
    c = MLP(rngs=nn.Rngs(1))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    assert not np.allclose(a.input.kernel, c.input.kernel)
    # each draw from the stream is a fresh key
    assert not np.allclose(a.input.kernel[:4, :4], a.output.kernel[:4, :4])
    same_key = MLP(rngs=nn.Rngs(jax.random.key(0)))
    np.testing.assert_array_equal(same_key.input.kernel, a.input.kernel)


def _public(owner):
    # the jaxtyping import hook used in tests adds a `jaxtyping` module attribute; skip it
    return sorted(n for n in dir(owner) if not n.startswith("_") and n != "jaxtyping")


def test_public_surface_is_short_and_documented():
    assert _public(tt) == [
        "StateDictError",
        "StateProblem",
        "nn",
    ]
    assert _public(nn) == [
        "BatchNorm",
        "Conv",
        "ConvTranspose",
        "Dropout",
        "Embed",
        "Lambda",
        "LayerNorm",
        "Linear",
        "Module",
        "MultiHeadAttention",
        "RMSNorm",
        "Rngs",
        "Sequential",
        "field",
    ]
    for owner in (tt, nn):
        for name in _public(owner):
            assert getattr(owner, name).__doc__, f"{owner.__name__}.{name} has no docstring"


def test_field_names_cannot_hide_module_methods():
    class M(nn.Module):
        def __init__(self):
            self.replace = jnp.ones(2)

    with pytest.raises(TypeError, match=r"M has a field named 'replace'.*rename the field"):
        M()


def test_built_modules_take_a_registered_node_class_of_the_same_name():
    m = MLP(rngs=nn.Rngs(0))
    node_type = type(m)
    assert node_type is not MLP and node_type.__mro__[1] is MLP and isinstance(m, MLP)
    assert node_type.__name__ == "MLP" and node_type.__qualname__ == MLP.__qualname__
    # calling the node class rebuilds a node from its fields, as JAX's unflatten does
    rebuilt = node_type(input=m.input, output=m.output)
    assert type(rebuilt) is node_type and rebuilt.input is m.input
    assert rebuilt != m and m == m  # modules compare by identity
    with pytest.raises(TypeError, match=r"subclass the class you defined instead"):
        type("Sub", (node_type,), {})
