"""nn.field() and declared fields: the options, the generated __init__ and its signature, and
which annotations declare a field. Every class is built inside its test, so that the code
that reads it runs in the test."""

import inspect
import re
import types
import typing
from typing import ClassVar

import jax
import jax.numpy as jnp
import pytest

from taktiny import nn


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"default": 1.0, "default_factory": list},
            "field() takes `default` or `default_factory`, not both.",
        ),
        (
            {"static": True, "trainable": False},
            "field(static=True, trainable=False) contradicts itself: a static field holds no "
            "arrays, so there is nothing to train or to keep from training. Drop one of them.",
        ),
    ],
)
def test_field_refuses_options_that_contradict_each_other(kwargs, message):
    with pytest.raises(TypeError) as error:
        nn.field(**kwargs)
    assert str(error.value) == message


def test_a_declared_field_takes_its_default_or_a_fresh_value_from_its_factory():
    class M(nn.Module):
        weight: jax.Array
        scale: float = nn.field(default=2.0)
        tag: str = "t"
        extra: list = nn.field(default_factory=list)
        count: int = nn.field(default=0, static=False)

    weight = jnp.ones(2)
    m = M(weight)
    assert m.weight is weight and m.scale == 2.0 and m.tag == "t" and m.extra == []
    assert isinstance(m.count, jax.Array) and int(m.count) == 0
    assert M(weight).extra is not m.extra  # the factory is called for each instance
    given = M(weight, 3.0, tag="u", extra=[1], count=5)
    assert (given.scale, given.tag, given.extra, int(given.count)) == (3.0, "u", [1], 5)
    with pytest.raises(TypeError, match=re.escape("missing a required argument: 'weight'")):
        M()
    with pytest.raises(TypeError, match=re.escape("got an unexpected keyword argument 'bias'")):
        M(weight, bias=weight)


def test_a_custom_init_that_leaves_a_field_unset_gets_its_default_or_factory_value():
    class M(nn.Module):
        weight: jax.Array
        tag: str = "t"
        extra: list = nn.field(default_factory=list)

        def __init__(self, weight):
            self.weight = weight

    a, b = M(jnp.ones(2)), M(jnp.ones(2))
    assert (a.tag, a.extra) == ("t", []) and a.extra is not b.extra


def test_the_generated_init_has_a_signature_like_a_dataclass_one():
    class M(nn.Module):
        weight: jax.Array
        scale: float = nn.field(default=2.0)
        tag: str = "t"
        extra: list = nn.field(default_factory=list)

    signature = inspect.signature(M.__init__)
    assert str(signature) == "(self, weight, scale=2.0, tag='t', extra=<factory>)"
    assert M.__init__.__qualname__ == f"{M.__qualname__}.__init__"


def test_a_subclass_without_its_own_init_takes_its_bases_fields_and_its_own():
    class Base(nn.Module):
        weight: jax.Array

    class Sub(Base):
        scale: float = 2.0

    class Custom(nn.Module):
        def __init__(self, weight):
            self.weight = weight

    class SubOfCustom(Custom):  # keeps the custom __init__: its annotation declares no argument
        scale: float = 3.0

    weight = jnp.ones(2)
    sub = Sub(weight, 4.0)
    assert sub.weight is weight and sub.scale == 4.0
    assert str(inspect.signature(Sub.__init__)) == "(self, weight, scale=2.0)"
    custom = SubOfCustom(weight)
    assert custom.weight is weight and custom.scale == 3.0  # the declared default, filled in
    with pytest.raises(TypeError, match=re.escape("takes 2 positional arguments but 3 were")):
        SubOfCustom(weight, 4.0)


@pytest.mark.parametrize(
    "body, message",
    [
        (
            "a: int = 1\nb: int\n",
            "M: non-default argument follows default argument; give the later fields defaults too.",
        ),
        (
            "w: int\nself: int = 1\n",
            "M declares a field named 'self', the name its generated __init__ gives the "
            "instance; rename the field.",
        ),
    ],
)
def test_declared_fields_that_cannot_make_an_init_are_refused(body, message):
    code = "class M(nn.Module):\n" + "".join(f"    {line}\n" for line in body.splitlines())
    with pytest.raises(TypeError) as error:
        exec(code, {"nn": nn})
    # Python 3.12 adds the argument's name: "non-default argument 'b' follows ..."
    assert re.sub(r" argument '\w+' follows", " argument follows", str(error.value)) == message


def test_annotated_dunder_names_stay_class_attributes():
    # Python's own annotated names (`__slots__`, `__match_args__`, ...) are never fields.
    class M(nn.Module):
        __match_args__: tuple = ("weight",)
        weight: jax.Array

    assert str(inspect.signature(M.__init__)) == "(self, weight)"
    assert M.__match_args__ == ("weight",)
    assert repr(M(jnp.zeros(2))) == "M(weight=f32[2])"


def test_annotations_name_classvar_also_as_strings():
    # A string annotation is looked up in the module that defines the class, as dataclasses
    # do: a bare or module-qualified ClassVar is a class variable; anything else is a field.
    class ClassVarLike:
        pass

    class M(nn.Module):
        bare: "ClassVar[int]" = 0
        qualified: "typing.ClassVar[str]" = "x"
        plain: "typing.ClassVar" = "y"
        by_class: "ClassVarLike.ClassVar" = None  # a prefix that is not a module: a field
        unknown: "nowhere.ClassVar" = None  # noqa: F821 (a prefix the module lacks: a field)
        unparsed: "(ClassVar)" = None  # not a name: a field
        weight: "jax.Array" = None

    assert ClassVar is typing.ClassVar  # (what the strings above name)
    assert list(M._taktiny_fields) == ["by_class", "unknown", "unparsed", "weight"]
    assert M.bare == 0 and M.qualified == "x" and M.plain == "y"


def test_string_annotations_of_a_class_from_an_unimported_module_are_read_with_typing():
    # a class made by exec (or in a module that is not in sys.modules) still has its
    # ClassVar strings read: the names are looked up in `typing`
    namespace = {"__name__": "not_imported_anywhere", "nn": nn}
    code = 'class M(nn.Module):\n    n: "ClassVar[int]" = 1\n    w: "Array" = None\n'
    exec(code, namespace)
    cls = namespace["M"]
    assert cls.__module__ == "not_imported_anywhere"
    assert list(cls._taktiny_fields) == ["w"] and cls.n == 1
    assert isinstance(cls(), types.SimpleNamespace) and cls().w is None


LAYER_CLASSES = sorted(
    (
        value
        for value in (getattr(nn, name) for name in nn.__all__)  # (imported when asked)
        if isinstance(value, type) and issubclass(value, nn.Module)
    ),
    key=lambda cls: cls.__name__,
)
assert len(LAYER_CLASSES) > 20  # (not only those some earlier test module imported)


@pytest.mark.parametrize("layer", LAYER_CLASSES, ids=lambda cls: cls.__name__)
def test_every_layer_shows_its_constructor_in_its_signature_and_help(layer):
    """`inspect.signature` (which IDEs, notebooks and `help()` use) shows the constructor's
    parameters, not the metaclass's `(*args, **kwargs)`."""
    import pydoc

    init = list(inspect.signature(layer.__init__).parameters.values())
    assert init[0].name == "self"
    signature = inspect.signature(layer)
    assert list(signature.parameters.values()) == init[1:]
    if layer is not nn.Module:
        assert signature.parameters and "args" not in signature.parameters
    page = pydoc.render_doc(layer, renderer=pydoc.plaintext)
    assert f"{layer.__name__}{signature}" in page


def test_a_users_module_shows_its_constructor_in_its_signature():
    class Declared(nn.Module):
        weight: jax.Array
        scale: float = 2.0

    class Written(nn.Module):
        def __init__(self, features: int, *, bias: bool = True):
            self.features, self.bias = features, bias

    class Sub(Declared):
        tag: str = "t"

    assert str(inspect.signature(Declared)) == "(weight, scale=2.0)"
    assert str(inspect.signature(Written)) == "(features: int, *, bias: bool = True)"
    assert str(inspect.signature(Sub)) == "(weight, scale=2.0, tag='t')"
    assert inspect.signature(Written).bind(3, bias=False).arguments == {
        "features": 3,
        "bias": False,
    }
    # a built module is called as its __call__ says, as before
    assert list(inspect.signature(nn.Lambda(abs)).parameters) == ["x"]
