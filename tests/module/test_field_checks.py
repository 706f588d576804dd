"""The checks run on a module's fields when it is built (`taktiny/module/_field_checks.py`), message for
message: the same module or array at two places (named at the shortest two places that hold
the one object), a function that holds a module (and how it holds it), a bound method of the
module being built, and a dict key that cannot name a parameter."""

import functools
import types

import jax
import pytest

from taktiny import nn

TIE_HINT = (
    "A PyTree holds each place separately, so the state would list it twice and the first "
    "training step would untie the two. To use one parameter in two places, store it once and "
    "use it twice: call the same submodule again, or, for an output projection tied to an "
    "embedding, call embed.attend(x) (nn.Embed). To start two parameters from the same values, "
    "store a copy (jnp.array(x))."
)


def twice_in_a_list(m, lin):
    m.blocks = [lin, lin]


def twice_in_a_dict(m, lin):
    m.blocks = {"a": lin, "b": lin}


def in_two_dicts(m, lin):
    m.first, m.second = {"x": lin}, {"x": lin}


def one_array_in_two_modules(m, lin):  # the modules differ, their kernels do not
    m.blocks = {"a": lin, "b": lin.replace(bias=lin.bias + 1)}


TIES = {
    "one module twice in a list": (twice_in_a_list, "M.blocks[0]", "M.blocks[1]", "Linear"),
    "one module twice in a dict": (twice_in_a_dict, "M.blocks['a']", "M.blocks['b']", "Linear"),
    "one module in two dicts": (in_two_dicts, "M.first['x']", "M.second['x']", "Linear"),
    "one array in two modules": (
        one_array_in_two_modules, "M.blocks['a'].kernel", "M.blocks['b'].kernel", "array"
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", TIES)
def test_a_tie_is_named_where_one_object_is_held_twice(case):
    build, first, second, kind = TIES[case]

    class M(nn.Module):
        def __init__(self):
            build(self, nn.Linear(2, 2, rngs=nn.Rngs(0)))

    with pytest.raises(TypeError) as info:
        M()
    assert str(info.value) == f"{first} and {second} are the same {kind}. {TIE_HINT}"


class Net(nn.Module):
    def __init__(self):
        self.a = nn.Linear(2, 2, rngs=nn.Rngs(0))
        self.blocks = [nn.Linear(2, 2, rngs=nn.Rngs(1)), nn.Linear(2, 2, rngs=nn.Rngs(2))]
        self.heads = {"x": nn.Linear(2, 2, rngs=nn.Rngs(3))}


def fresh():
    return nn.Linear(2, 2, rngs=nn.Rngs(4))


REPLACED = {
    "a kept field": (lambda n: {"blocks": [n.blocks[0], n.a]}, "Net.a", "Net.blocks[1]"),
    "a kept list's item": (lambda n: {"a": n.blocks[0]}, "Net.a", "Net.blocks[0]"),
    "a kept dict's item": (lambda n: {"a": n.heads["x"]}, "Net.a", "Net.heads['x']"),
    "the new value itself": (
        lambda n: {"blocks": [fresh()] * 2}, "Net.blocks[0]", "Net.blocks[1]"
    ),
    "nothing": (lambda n: {"a": fresh(), "heads": {"x": fresh(), "y": fresh()}}, None, None),
}  # fmt: skip


@pytest.mark.parametrize("case", REPLACED)
def test_replace_refuses_a_new_value_tied_to_itself_or_to_what_it_keeps(case):
    changes, first, second = REPLACED[case]
    net = Net()
    if first is None:
        assert len(jax.tree.leaves(net.replace(**changes(net)))) == 10
        return
    with pytest.raises(TypeError) as info:
        net.replace(**changes(net))
    assert str(info.value) == f"{first} and {second} are the same Linear. {TIE_HINT}"


def apply(*args, **kwargs):
    return args, kwargs


def closure_after_an_empty_cell(layer):
    a_unset = None
    del a_unset  # its cell, the closure's first, is empty when f is stored

    def f(x):
        return a_unset, z_layer(x)  # noqa: F821 - deleted above: an empty cell

    z_layer = layer
    return f


def shared(m, layer):  # the same list 3 deep, then (searched again: shorter) 1 deep
    inner = [[layer]]
    return functools.partial(apply, [[inner]], inner)


HIDDEN = {
    "a closure": (lambda m, lin: lambda x: lin(x), "a Linear module (in a closure)"),
    "a closure with an empty cell": (
        lambda m, lin: closure_after_an_empty_cell(lin), "a Linear module (in a closure)"
    ),
    "partial's function": (
        lambda m, lin: functools.partial(lin), "a Linear module (inside functools.partial)"
    ),
    "partial's keyword": (
        lambda m, lin: functools.partial(apply, layer=lin),
        "a Linear module (inside functools.partial)",
    ),
    "a list in a partial": (
        lambda m, lin: functools.partial(apply, [lin]), "a Linear module (in a container)"
    ),
    "a dict in a partial": (
        lambda m, lin: functools.partial(apply, {"a": lin}), "a Linear module (in a container)"
    ),
    "four levels deep": (
        lambda m, lin: functools.partial(apply, [[[lin]]]), "a Linear module (in a container)"
    ),
    "reached again by a shorter path": (shared, "a Linear module (in a container)"),
    "a transformation": (
        lambda m, lin: jax.vmap(lin),
        "a Linear module (wrapped by a function transformation (jax.vmap, jax.jit, ...))",
    ),
    "another module's bound method": (
        lambda m, lin: lin.__call__, "a Linear module (as the object of a bound method)"
    ),
    "a module bound as a method": (
        lambda m, lin: types.MethodType(lin, object()), "a Linear module (in a bound method)"
    ),
    "the module being built": (
        lambda m, lin: functools.partial(apply, m), "this M itself (inside functools.partial)"
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", HIDDEN)
def test_a_function_holding_a_module_is_refused_and_says_how_it_holds_it(case):
    make, what = HIDDEN[case]

    class M(nn.Module):
        def __init__(self):
            self.f = make(self, nn.Linear(2, 2, rngs=nn.Rngs(0)))

    with pytest.raises(TypeError) as info:
        M()
    assert str(info.value) == (
        f"M.f is a function that holds {what}. A function is static, so that module's "
        f"parameters would vanish from the state, get no gradient, and ignore loads. Store the "
        f"module itself in a field (self.f = layer) and apply the function when calling it: "
        f"jax.vmap(self.f)(x), functools.partial(self.f, ...)(x)."
    )


def test_the_search_for_a_hidden_module_stops_four_levels_deep():
    class M(nn.Module):
        def __init__(self):
            self.f = functools.partial(apply, [[[[nn.Linear(2, 2, rngs=nn.Rngs(0))]]]])
            self.g = jax.nn.gelu

    assert M().f.args[0][0][0][0][0].kernel.shape == (2, 2)


@pytest.mark.parametrize(
    "method, name", [(lambda m: m.double, "double"), (lambda m: types.MethodType(
        functools.partial(apply), m), "method")]
)  # fmt: skip
def test_a_bound_method_of_the_module_being_built_is_refused(method, name):
    class M(nn.Module):
        def __init__(self):
            self.f = method(self)

        def double(self, x):
            return 2 * x

    with pytest.raises(TypeError) as info:
        M()
    assert str(info.value) == (
        f"M.f holds the bound method M.{name} of the module being built. A function is static, "
        f"so the method would keep this module as it is now: after a load or a training step it "
        f"would still compute with the old parameters, and jax.grad through it would be zero. "
        f"Call the method where you need it (self.{name}(x) in __call__) instead of storing it, "
        f"or store a plain function (self.f = jax.nn.gelu)."
    )


@pytest.mark.parametrize("key, rename", [("a.b", "'a_b'"), (3, "'3'"), ("a.b.c", "'a_b_c'")])
def test_a_dict_key_that_cannot_name_a_parameter_is_refused(key, rename):
    class M(nn.Module):
        def __init__(self):
            self.d = {key: jax.numpy.zeros(1)}

    with pytest.raises(TypeError) as info:
        M()
    assert str(info.value) == (
        f"M.d has the dict key {key!r}. Keys of dicts inside a module name parameters, so they "
        f"must be strings without '.' (a '.' joins flat names); rename it, e.g. {rename}."
    )
