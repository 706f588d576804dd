"""nn.Module: field rules, freezing, PyTree registration, transformations, repr, replace."""

import copy
import dataclasses
import functools
import re
import typing
from pathlib import Path
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import MLP

import taktiny as tt
from taktiny import nn
from taktiny.module import _module


def leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(la, lb, strict=True)
    )


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


def test_parameterless_submodules_are_children_and_static_fields_never_are():
    """Every submodule is a child of the tree, even one without parameters (Dropout, Lambda),
    so tree tools reach it; a field declared static stays out of the children even while it
    holds None."""

    class M(nn.Module):
        gate: typing.Any = nn.field(default=None, static=True)

        def __init__(self):
            self.drop = nn.Dropout(0.5)
            self.w = jnp.ones(2)

    m = M()
    paths = jax.tree_util.tree_flatten_with_path(
        m, is_leaf=lambda x: x is None or (isinstance(x, nn.Module) and x is not m)
    )[0]
    assert [jax.tree_util.keystr(path) for path, _ in paths] == [".drop", ".w"]
    swapped = eqx.tree_at(lambda t: t.drop, m, nn.Dropout(0.1))
    assert swapped.drop.rate == 0.1 and m.drop.rate == 0.5


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
    (count,) = jax.tree.leaves(m)
    assert isinstance(count, jax.Array) and int(count) == 3
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
    with pytest.raises(dataclasses.FrozenInstanceError) as error:
        del m.output
    assert str(error.value) == "cannot delete MLP.output: modules are immutable once built."


def test_init_may_delete_what_it_set():
    class M(nn.Module):
        def __init__(self):
            self.w = jnp.ones(2)
            self.scratch = jnp.zeros(2)
            del self.scratch

    m = M()
    assert type(m)._taktiny_layout == (("w", True),) and not hasattr(m, "scratch")


def test_replace_returns_a_checked_copy():
    m = MLP(rngs=nn.Rngs(0))
    other = nn.Linear(32, 64, rngs=nn.Rngs(1))
    m2 = m.replace(input=other)
    assert m2.input is other and m.input is not other and m2.output is m.output
    expected = "MLP.replace() got unknown field(s) ['inputs']; its fields are ['input', 'output']."
    with pytest.raises(TypeError, match=f"^{re.escape(expected)}$"):
        m.replace(inputs=other)
    with pytest.raises(TypeError, match=r"Lambda\(fn\)"):
        m.replace(input=[other, "not-an-array"])


@pytest.mark.parametrize(
    "before, after",
    [
        ([0, 1], [None, None]),  # every item swapped for None: nothing left to be data
        ([0, 1], [None, 1]),
        ([0, 1], [2, 1]),
        ([0, 1], [1, 0]),
        ({"a": 0, "b": 1}, {"a": None, "b": None}),
        ({"a": 0, "b": 1}, {"a": 2, "b": 1}),
        ((0,), (None,)),
    ],
)
def test_replace_sorts_a_container_as_building_with_it_would(before, after):
    # replace() checks only the swapped items of a list, tuple or dict; the module it gives
    # must still have the layout (and so the tree structure) of one built with the new value
    arrays = [jnp.full(2, float(i)) for i in range(3)]
    pick = lambda ix: jax.tree.map(lambda i: arrays[i], ix)

    class M(nn.Module):
        def __init__(self, items):
            self.items = items

    replaced = M(pick(before)).replace(items=pick(after))
    built = M(pick(after))
    assert type(replaced) is type(built)
    assert jax.tree.structure(replaced) == jax.tree.structure(built)
    assert jax.tree.leaves(replaced) == jax.tree.leaves(built)  # the same arrays


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


def _same_layout_classes():
    """Two classes of one layout (a field `w`) whose calls differ."""

    class Add(nn.Module):
        def __init__(self):
            self.w = jnp.ones(2)

        def __call__(self, x):
            return x + self.w

    class Scale(nn.Module):
        def __init__(self):
            self.w = jnp.ones(2)

        def __call__(self, x):
            return x * self.w * 5

    return Add, Scale


def test_structures_of_two_classes_with_one_layout_differ():
    # JAX 0.10 compares dataclass nodes by arity and meta values, not by class: without a
    # meta value of its own per node class, these two structures compared equal, and a
    # jitted function met with a hash collision in its cache reused the program of the
    # other class (about 1 call in 70: silently wrong results)
    Add, Scale = _same_layout_classes()
    add, scale = jax.tree.structure(Add()), jax.tree.structure(Scale())
    assert add != scale
    assert add == jax.tree.structure(Add())  # one class, one layout: one structure
    assert str(add) == "PyTreeDef(CustomNode(Add[(<Add>,)], [*]))"
    wrong = 0  # (the structures' equality above fails first; these calls show the cost)
    for _ in range(50):
        Add, Scale = _same_layout_classes()
        call = jax.jit(lambda module, x: module(x))
        call(Add(), jnp.ones(2))
        wrong += float(call(Scale(), jnp.ones(2))[0]) != 5.0
    assert wrong == 0
    # a rebuilt module (JAX's unflatten) flattens to the same structure as a built one
    rebuilt = jax.tree.map(lambda x: x, Scale())
    assert jax.tree.structure(rebuilt) == jax.tree.structure(Scale())
    assert list(_module.fields_of(rebuilt)) == ["w"]


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
    # abstract arrays (a model from jax.eval_shape) read the same way
    abstract = jax.eval_shape(lambda: nn.Linear(32, 64, rngs=nn.Rngs(0)))
    assert repr(abstract) == "Linear(kernel=f32[32,64], bias=f32[64])"
    # the indent asked for is the indent given
    assert eqx.tree_pformat(MLP(rngs=nn.Rngs(0)), indent=4) == (
        "MLP(\n    input=Linear(kernel=f32[32,64], bias=f32[64]),\n"
        "    output=Linear(kernel=f32[64,4], bias=f32[4])\n)"
    )


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
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.allclose(a.input.kernel, c.input.kernel)
    # each draw from the stream is a fresh key
    assert not np.allclose(a.input.kernel[:4, :4], a.output.kernel[:4, :4])
    same_key = MLP(rngs=nn.Rngs(jax.random.key(0)))
    np.testing.assert_array_equal(same_key.input.kernel, a.input.kernel)


@pytest.mark.parametrize(
    "seed",
    [
        pytest.param(lambda: 7, id="int"),
        pytest.param(lambda: jax.random.key(7), id="typed key"),
        pytest.param(lambda: jax.random.PRNGKey(7), id="raw uint32[2] key"),
    ],
)
def test_rngs_streams_fold_the_draw_count_into_the_seed_key(seed):
    # key n of the stream is fold_in(key(seed), n), whichever form the seed takes
    rngs = nn.Rngs(seed())
    assert repr(rngs) == "Rngs(drawn=0)"
    drawn = [rngs() for _ in range(3)]
    assert repr(rngs) == "Rngs(drawn=3)"
    for n, key in enumerate(drawn):
        assert key.shape == () and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
        expected = jax.random.fold_in(jax.random.key(7), n)
        np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(expected))


def _public(owner):
    # the jaxtyping import hook used in tests adds a `jaxtyping` module attribute, and
    # `make mutate` (mutmut) adds its variants as attributes whose names hold "ǁ": skip them
    return sorted(
        n for n in dir(owner) if not n.startswith("_") and n != "jaxtyping" and "ǁ" not in n
    )


IMPLEMENTATION = ("arrays", "quant", "state", "module", "sharding", "loading")


def test_public_surface_is_short_and_documented():
    # the packages that hold the implementation (docs/architecture.md) are attributes of
    # taktiny once imported; their public names are re-exported here, in tt.nn and in tt.io
    # (`models`, above the library's floors, is imported as `from taktiny import models`)
    public = [n for n in _public(tt) if n not in (*IMPLEMENTATION, "models")]
    assert public == [
        "QArray",
        "Schema",
        "SelectionError",
        "ShardingPlan",
        "StateDictError",
        "StateProblem",
        "Summary",
        "by_name",
        "convert",
        "dequantize",
        "eval_shape",
        "flat_state_dict",
        "io",
        "load_flat_state_dict",
        "load_state_dict",
        "lora",
        "merge_lora",
        "migrate",
        "nn",
        "quantize",
        "schema",
        "shard",
        "sharding_plan",
        "state_dict",
        "summary",
        "trainable",
    ]
    assert _public(nn) == [
        "AvgPool",
        "BatchNorm",
        "Conv",
        "ConvTranspose",
        "Dropout",
        "Embed",
        "GlobalAvgPool",
        "GroupNorm",
        "KVCache",
        "Lambda",
        "LayerNorm",
        "Linear",
        "LoRAEmbed",
        "LoRALinear",
        "MaxPool",
        "Module",
        "MultiHeadAttention",
        "QuantizedEmbed",
        "QuantizedLinear",
        "RMSNorm",
        "Rngs",
        "RotaryEmbedding",
        "Sequential",
        "Stack",
        "field",
        "train_forward",
    ]
    # imported when first used (the CLI imports no JAX): every name resolves, and * has them
    assert tt.__all__ == public and all(getattr(tt, n) is not None for n in tt.__all__)
    assert tt.io.__all__ == _public(tt.io)
    with pytest.raises(AttributeError, match="module 'taktiny' has no attribute 'laod_state_di"):
        tt.laod_state_dict  # noqa: B018
    assert _public(tt.io) == sorted([
        "BackgroundSave", "Checkpoint", "LoadPlan", "PlannedStep", "SafetensorsError", "Tensor",
        "load_safetensors", "open_safetensors", "plan_load", "read_torch", "save_safetensors",
    ])  # fmt: skip
    assert _public(tt.convert) == sorted([
        "ConversionError", "ConversionProblem", "Converted", "Ignore", "Init", "Report", "Rule", "Step", "Tie",
        "Transform", "cast", "chain", "check", "concatenate", "convert", "export", "identity",
        "reshape", "round_trip_check", "split", "stack", "transpose", "unstack",
        "quantize", "dequantize",
        "flip", "Parity", "ParityOutput", "parity",
        "linear", "conv", "conv_transpose", "layer_norm", "embedding", "batch_norm",
        "multihead_attention", "pytorch", "group_norm", "buffers",
        "resume", "torch_adam",
        "quantized_rules", "export_compressed_tensors", "dequantize_blocks", "unpack_quantized",
    ])  # fmt: skip
    for owner in (tt, tt.io, tt.convert, nn):
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
    assert node_type.__module__ == MLP.__module__ and node_type.__doc__ == MLP.__doc__

    class Local(nn.Module):  # its qualified name is not its name
        w: jax.Array

    assert type(Local(jnp.ones(1))).__qualname__ == Local.__qualname__
    # calling the node class rebuilds a node from its fields, as JAX's unflatten does
    rebuilt = node_type(input=m.input, output=m.output)
    assert type(rebuilt) is node_type and rebuilt.input is m.input
    assert rebuilt != m and m == m  # modules compare by identity
    with pytest.raises(TypeError, match=r"subclass the class you defined instead"):
        type("Sub", (node_type,), {})


# --- construction cases that used to be silently wrong ----------------------------------


def test_a_bound_method_of_the_module_cannot_be_stored():
    # Once: the method became static and kept pointing at the old module, so a loaded model
    # still computed with the old weights and jax.grad through it was zero.
    class Net(nn.Module):
        def __init__(self):
            self.linear = nn.Linear(2, 2, rngs=nn.Rngs(0))
            self.act = self._gelu

        def _gelu(self, x):
            return jax.nn.gelu(self.linear(x))

    with pytest.raises(
        TypeError,
        match=r"Net\.act holds the bound method Net\._gelu of the module being built.*"
        r"self\._gelu\(x\) in __call__",
    ):
        Net()


@pytest.mark.parametrize(
    "wrap, how",
    [
        (jax.vmap, "wrapped by a function transformation"),
        (jax.jit, "wrapped by a function transformation"),
        (lambda layer: functools.partial(layer), "inside functools.partial"),
        (lambda layer: lambda x: layer(x), "in a closure"),
        (lambda layer: layer.__call__, "as the object of a bound method"),
    ],
)
def test_a_layer_hidden_in_a_function_cannot_be_stored(wrap, how):
    # Once: the function was static, so the layer's weights vanished from the state and got
    # no gradient.
    class Net(nn.Module):
        def __init__(self):
            self.f = wrap(nn.Linear(2, 2, rngs=nn.Rngs(0)))

    with pytest.raises(
        TypeError,
        match=rf"Net\.f is a function that holds a Linear module \({how}.*"
        r"parameters would vanish from the state.*jax\.vmap\(self\.f\)\(x\)",
    ):
        Net()


def test_functions_without_modules_stay_static():
    class Net(nn.Module):
        def __init__(self):
            self.act = functools.partial(jax.nn.gelu, approximate=False)
            self.scale = jax.jit(lambda x: x * 2)
            self.w = jnp.ones(2)

    net = Net()
    assert jax.tree.leaves(net) == [net.w]


def test_post_init_beside_a_custom_init_is_an_error():
    # Once: __post_init__ silently never ran.
    with pytest.raises(TypeError, match=r"M has both its own __init__ and a __post_init__"):

        class M(nn.Module):
            def __init__(self):
                self.w = jnp.ones(2)

            def __post_init__(self):
                raise AssertionError("never reached")

    class Base(nn.Module):
        def __init__(self):
            self.w = jnp.ones(2)

    with pytest.raises(TypeError, match=r"Sub has both its own __init__ and a __post_init__"):

        class Sub(Base):
            w: jax.Array

            def __post_init__(self):
                pass


def test_post_init_runs_after_a_generated_init_even_without_fields():
    class Checked(nn.Module):
        def __post_init__(self):
            self.ran = True

    assert Checked().ran is True


@pytest.mark.parametrize("tie", ["module", "array", "nested array", "list"])
def test_the_same_module_or_array_at_two_places_is_refused(tie):
    # Once: both places were listed in the state, and one SGD step untied them.
    class LM(nn.Module):
        def __init__(self):
            self.embed = nn.Embed(10, 4, rngs=nn.Rngs(0))
            if tie == "module":
                self.out = self.embed
            elif tie == "array":
                self.out = self.embed.embedding
            elif tie == "nested array":
                self.out = {"w": self.embed.embedding}
            else:
                self.blocks = [self.embed, self.embed]

    where = {
        "module": r"LM\.embed and LM\.out are the same Embed",
        "array": r"LM\.embed\.embedding and LM\.out are the same array",
        "nested array": r"LM\.embed\.embedding and LM\.out\['w'\] are the same array",
        "list": r"LM\.embed and LM\.blocks\[0\] are the same Embed",
    }[tie]
    with pytest.raises(TypeError, match=where + r".*embed\.attend\(x\)"):
        LM()


def test_replace_cannot_tie_either_but_shared_parameterless_modules_are_fine():
    # replace() costs what its new values cost: they are searched whole, and compared with
    # the other fields' own values and their list, tuple and dict items
    m = MLP(rngs=nn.Rngs(0))
    with pytest.raises(TypeError, match=r"MLP\.input and MLP\.output are the same Linear"):
        m.replace(output=m.input)
    linear = m.input.replace(bias=jnp.zeros(64))
    with pytest.raises(
        TypeError,
        match=r"Sequential\.layers\[0\]\.kernel and Sequential\.layers\[1\]\.kernel are the same",
    ):
        nn.Sequential(linear).replace(layers=(m.input, linear))
    act = nn.Lambda(jax.nn.relu)
    net = nn.Sequential(act, nn.Linear(2, 2, rngs=nn.Rngs(0)), act)
    assert len(jax.tree.leaves(net)) == 2


def test_replace_that_swaps_container_items_still_refuses_ties_and_mixed_containers():
    class M(nn.Module):
        def __init__(self, head, blocks, tail, cfg=(1, 2)):
            self.head = head
            self.blocks = blocks
            self.tail = tail
            self.cfg = cfg

    head, tail, *blocks = (nn.Linear(2, 2, rngs=nn.Rngs(i)) for i in range(4))
    m = M(head, blocks, tail)
    fresh = nn.Linear(2, 2, rngs=nn.Rngs(9))
    for changes, where in [
        ({"blocks": [head, blocks[1]]}, r"M\.head and M\.blocks\[0\]"),
        ({"blocks": [fresh, head]}, r"M\.head and M\.blocks\[1\]"),  # every item swapped
        ({"blocks": [blocks[0], tail]}, r"M\.blocks\[1\] and M\.tail"),
        ({"head": fresh, "blocks": [fresh, blocks[1]]}, r"M\.head and M\.blocks\[0\]"),
    ]:
        with pytest.raises(TypeError, match=where + r" are the same Linear\. A PyTree holds"):
            m.replace(**changes)
    # a static tuple that takes an array among its numbers is sorted in full, and refused
    with pytest.raises(TypeError, match=re.escape("M.cfg[0] is 1, beside arrays or modules")):
        m.replace(cfg=(1, jnp.ones(2)))


def test_replace_sorts_again_only_what_it_changes(monkeypatch):
    # the cost rule of replace(): a list, tuple or dict that only swaps items for arrays or
    # modules has those items checked, without sorting the field again; a field declared
    # static=False, or one whose items are swapped for anything else, is sorted in full
    class M(nn.Module):
        blocks: list
        counts: list = nn.field(static=False)

    sorted_fields = []
    classify = _module._classify
    monkeypatch.setattr(
        _module,
        "_classify",
        lambda obj, owner, name, *rest: (
            sorted_fields.append(name) or classify(obj, owner, name, *rest)
        ),
    )
    m = M([jnp.ones(2), jnp.zeros(2)], [jnp.ones(()), 2])
    assert sorted_fields == ["blocks", "counts"]
    sorted_fields.clear()
    swapped = m.replace(blocks=[jnp.full(2, 3.0), m.blocks[1]])
    assert sorted_fields == [] and swapped.blocks[1] is m.blocks[1]
    m.replace(counts=[jnp.full((), 3), m.counts[1]])
    m.replace(blocks=[None, m.blocks[1]])
    m.replace(blocks=[m.blocks[1], m.blocks[0], jnp.ones(2)])  # not the same size
    assert sorted_fields == ["counts", "blocks", "blocks"]


def test_python_scalars_forced_into_the_state_become_arrays():
    # Once: they came out of flat_state_dict() as Python numbers, came back from Orbax as
    # arrays, and a load error then claimed the model held int32.
    class Counter(nn.Module):
        count: int = nn.field(static=False)
        rate: float = nn.field(static=False)
        flags: tuple = nn.field(static=False)

    c = Counter(count=3, rate=0.5, flags=(True, 2))
    flat = c.flat_state_dict()
    assert list(flat) == ["count", "rate", "flags.0", "flags.1"]
    assert all(isinstance(v, jax.Array) for v in flat.values())
    assert [v.dtype for v in flat.values()] == [jnp.int32, jnp.float32, jnp.bool_, jnp.int32]
    assert not any(v.weak_type for v in flat.values())
    with pytest.raises(
        tt.StateDictError, match=r"'count': dtype kind changes: the model holds int32"
    ):
        c.load_flat_state_dict({"count": np.float32(1.0)})


def test_a_forced_field_converts_only_its_own_python_numbers():
    # The numbers directly in a static=False field become arrays; a module in it is kept as
    # it is (the same object, whatever its leaves hold), and a value with no number to
    # convert is stored as given.
    class Forced(nn.Module):
        items: list = nn.field(static=False)

    linear = nn.Linear(2, 2, rngs=nn.Rngs(0))
    halves = jax.tree.map(lambda x: x.ndim + 0.5, linear)  # leaves: Python floats
    array = jnp.ones(3)
    mixed = Forced([linear, halves, 2, array])
    assert mixed.items[0] is linear and mixed.items[1] is halves
    assert type(halves.kernel) is float and mixed.items[3] is array
    number = mixed.items[2]
    assert isinstance(number, jax.Array) and number.dtype == jnp.int32 and int(number) == 2
    given = [halves, linear]
    assert Forced(given).items is given


def test_annotations_name_classvar_by_type_not_by_substring():
    # Once: a substring test dropped any field whose annotation merely mentioned ClassVar.
    class ClassVarLike:
        pass

    class M(nn.Module):
        weight: ClassVarLike
        counter: ClassVar[int] = 0
        quoted: "typing.ClassVar[str]" = "x"

    assert list(M._taktiny_fields) == ["weight"]
    m = M(weight=ClassVarLike())
    assert isinstance(m.weight, ClassVarLike)


@pytest.mark.program
def test_string_annotations_are_read_like_dataclasses():
    import subprocess
    import sys

    code = (
        "from __future__ import annotations\n"
        "import typing\n"
        "from typing import ClassVar\n"
        "import jax, jax.numpy as jnp\n"
        "from taktiny import nn\n"
        "class ClassVarish: ...\n"
        "class M(nn.Module):\n"
        "    w: jax.Array\n"
        "    a: ClassVar[int] = 1\n"
        "    b: typing.ClassVar[int] = 2\n"
        "    c: ClassVarish = None\n"
        "print(list(M._taktiny_fields))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "['w', 'c']", result.stderr[-2000:]


@pytest.mark.parametrize("name", sorted(n for n in _module._RESERVED if "ǁ" not in n))
def test_no_field_can_take_the_name_of_a_module_attribute(name):
    class M(nn.Module):
        def __init__(self):
            setattr(self, name, jnp.ones(2))

    with pytest.raises(TypeError, match=rf"M has a field named '{name}'.*rename the field"):
        M()


def test_every_public_method_is_reserved():
    public = set(_public(nn.Module))
    assert public == {"state_dict", "flat_state_dict", "load_state_dict",
                      "load_flat_state_dict", "replace"}  # fmt: skip
    assert public <= _module._RESERVED


def test_a_field_named_like_a_private_helper_keeps_repr_and_replace_working():
    # Once: a field called `_fields` hid the method that repr and replace used.
    class M(nn.Module):
        def __init__(self):
            self._fields = jnp.ones(2)
            self.fields = jnp.zeros(2)

    m = M()
    assert repr(m) == "M(_fields=f32[2], fields=f32[2])"
    assert m.replace(fields=jnp.ones(2)).fields[0] == 1


# --- pickle and copy --------------------------------------------------------------------


class Picklable(nn.Module):
    """At module level, so pickle finds it by name."""

    def __init__(self, flag):
        self.body = MLP(rngs=nn.Rngs(0))
        self.tag = "t" if flag else jnp.ones(2)


@pytest.mark.parametrize("flag", [True, False])
def test_pickle_and_deepcopy_round_trip(flag):
    import pickle

    m = Picklable(flag)
    for copied in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m)):
        assert type(copied) is type(m) and isinstance(copied, Picklable)
        assert jax.tree.structure(copied) == jax.tree.structure(m)
        assert leaves_equal(copied, m)
        assert copied.body.input.kernel is not m.body.input.kernel
    shallow = copy.copy(m)
    assert type(shallow) is type(m) and shallow.body is m.body


def test_cloudpickle_round_trips_a_class_defined_in_a_test():
    import cloudpickle

    class Local(nn.Module):
        def __init__(self):
            self.layers = nn.Sequential(nn.Linear(3, 3, rngs=nn.Rngs(0)), jax.nn.gelu)
            self.steps = jnp.zeros((), jnp.int32)

        def __call__(self, x):
            return self.layers(x)

    m = Local()
    copied = cloudpickle.loads(cloudpickle.dumps(m))
    assert isinstance(copied, Local) and type(copied).__name__ == "Local"
    x = jnp.ones((2, 3))
    np.testing.assert_array_equal(jax.jit(lambda m: m(x))(copied), m(x))
    loaded = copied.load_flat_state_dict({"steps": np.int32(4)})
    assert int(loaded.steps) == 4


@pytest.mark.program
def test_unpickling_in_a_fresh_process_registers_the_node_class(tmp_path):
    import pickle
    import subprocess
    import sys

    path = tmp_path / "model.pkl"
    path.write_bytes(pickle.dumps(MLP(rngs=nn.Rngs(3))))
    code = (
        "import pickle, sys, jax, jax.numpy as jnp\n"
        f"sys.path.insert(0, {str(Path(__file__).parents[1])!r})\n"
        f"m = pickle.loads(open({str(path)!r}, 'rb').read())\n"
        "print(len(jax.tree.leaves(m)), jax.jit(lambda m: m(jnp.ones(32)))(m).shape)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "4 (4,)", result.stderr[-2000:]


@pytest.mark.parametrize(
    "value, where",
    [
        ({"attn.q": np.ones(2)}, "'attn.q'"),
        ([{"attn.q": np.ones(2)}], "'attn.q'"),
        ({"a": {"b": [{"c.d": np.ones(2)}]}}, "'c.d'"),
        ((np.ones(2), {"e": {"f.g": np.ones(2)}}), "'f.g'"),
        ([{0: np.ones(2)}], "0"),
    ],
)
def test_dict_keys_are_checked_at_every_depth(value, where):
    # a dotted key deep inside a field would give an ambiguous flat name
    class M(nn.Module):
        def __init__(self, value):
            self.blocks = jax.tree.map(jnp.asarray, value)  # (JAX arrays made in the test)

    with pytest.raises(TypeError, match=rf"M\.blocks has the dict key {where}\."):
        M(value)


@pytest.mark.program
def test_in_a_plain_process_bad_arguments_read_the_same_and_a_load_inside_jit_comes_first():
    # One fresh interpreter (no beartype, no earlier load) for two checks. The tests run
    # under beartype, which rejects bad calls before Taktiny sees them: a user's process has
    # no such hook, so the messages users get are read here. And a regression: the concrete
    # array class was once learnt from a traced array when the process's first load happened
    # inside jit, and every later load then failed.
    import subprocess
    import sys

    code = (
        "import jax, jax.numpy as jnp, taktiny as tt\n"
        "from taktiny import nn\n"
        "m = nn.Linear(2, 2, rngs=nn.Rngs(0))\n"
        "s = nn.Linear(2, 2, rngs=nn.Rngs(1)).state_dict()\n"
        "inside = jax.jit(lambda m, s: m.load_state_dict(s))(m, s)\n"
        "outside = m.load_state_dict(s)\n"
        "assert (inside.kernel == outside.kernel).all()\n"
        "print('loaded')\n"
        "for call in (lambda: m.load_state_dict(m), lambda: tt.load_flat_state_dict([m], [1]),\n"
        "             lambda: tt.by_name(['head.**'])):\n"
        "    try:\n"
        "        call()\n"
        "    except TypeError as error:\n"
        "        print(error)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.splitlines() == [
        "loaded",
        "Linear.load_state_dict() expects a dict, got Linear.",
        "taktiny.load_flat_state_dict(list) expects a dict, got list.",
        "taktiny.by_name takes its rules as a dict {pattern: value} or a list of (pattern, "
        "value) pairs, got the entry 'head.**'.",
    ], result.stderr[-2000:]
