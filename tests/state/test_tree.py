"""Names for any PyTree (optimizer states), trainable masks and values chosen by name, with
optax as the user runs it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import MLP

import taktiny as tt
from taktiny import nn


class Classifier(nn.Module):
    def __init__(self, num_classes, *, rngs):
        self.encoder = MLP(rngs=rngs)
        self.head = nn.Linear(4, num_classes, rngs=rngs)

    def __call__(self, x):
        return self.head(self.encoder(x))


class Normed(nn.Module):
    def __init__(self, *, rngs):
        self.linear = nn.Linear(3, 4, rngs=rngs)
        self.norm = nn.BatchNorm(4)

    def __call__(self, x):
        return self.norm(self.linear(x))


def test_an_optimizer_state_is_named_like_the_model(optax_promotion):
    model = Classifier(3, rngs=nn.Rngs(0))
    opt_state = optax.adam(1e-3).init(model)
    state = tt.state_dict(opt_state)
    assert list(state) == ["0"]
    assert list(state["0"]) == ["count", "mu", "nu"]
    assert state["0"]["mu"]["encoder"]["input"]["kernel"] is opt_state[0].mu.encoder.input.kernel
    flat = tt.flat_state_dict(opt_state)
    assert list(flat)[:3] == ["0.count", "0.mu.encoder.input.kernel", "0.mu.encoder.input.bias"]
    assert len(flat) == 1 + 2 * len(model.flat_state_dict())
    # for a module, the functions are the methods
    assert tt.flat_state_dict(model).keys() == model.flat_state_dict().keys()


def test_a_new_head_gets_fresh_moments_while_the_encoder_keeps_its_own(optax_promotion):
    # pytorch#34660: restore part of an optimizer state
    optimizer = optax.adam(1e-2)
    x = jnp.ones((8, 32))
    old = Classifier(3, rngs=nn.Rngs(0))
    old_state = optimizer.init(old)
    grads = jax.grad(lambda m: jnp.sum(m(x) ** 2))(old)
    _, old_state = optimizer.update(grads, old_state, old)
    saved = tt.state_dict(old_state)

    new = Classifier(10, rngs=nn.Rngs(1))
    fresh = optimizer.init(new)
    part = {"0": {k: {"encoder": saved["0"][k]["encoder"]} for k in ("mu", "nu")}}
    restored = tt.load_state_dict(fresh, part)
    assert type(restored) is type(fresh)
    assert restored[0].mu.encoder.input.kernel is old_state[0].mu.encoder.input.kernel
    assert restored[0].mu.head.kernel is fresh[0].mu.head.kernel
    assert int(restored[0].count) == 0
    # the same checks as a model's loads: a wrong shape is one clear error, nothing loaded
    bad = {"0": {"mu": {"head": {"kernel": saved["0"]["mu"]["head"]["kernel"]}}}}
    with pytest.raises(
        tt.StateDictError,
        match=r"taktiny\.load_state_dict\(tuple\): 1 problem; nothing was loaded\.\n"
        r"  - '0\.mu\.head\.kernel': shape mismatch: expected \(4, 10\), got \(4, 3\)",
    ):
        tt.load_state_dict(fresh, bad)
    flat = tt.load_flat_state_dict(fresh, {"0.count": np.int32(5)})
    assert int(flat[0].count) == 5


def test_any_container_and_its_errors():
    tree = {"models": [MLP(rngs=nn.Rngs(0))], "step": jnp.zeros((), jnp.int32), "none": None}
    assert list(tt.flat_state_dict(tree))[-1] == "step"
    loaded = tt.load_flat_state_dict(tree, {"step": np.int32(3)})
    assert int(loaded["step"]) == 3 and loaded["models"][0] is tree["models"][0]
    with pytest.raises(TypeError, match=r"has the key 'a\.b' at \['a\.b'\], which cannot be part"):
        tt.state_dict({"a.b": jnp.ones(2)})
    with pytest.raises(TypeError, match=r"a ArrayImpl is a single array, so it has no names"):
        tt.state_dict(jnp.ones(2))
    with pytest.raises(tt.StateDictError, match=r"'stpe': unknown key; did you mean 'step'\?"):
        tt.load_flat_state_dict(tree, {"stpe": 1})


def test_trainable_marks_non_trainable_fields_and_is_what_optax_takes(optax_promotion):
    model = Normed(rngs=nn.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (16, 3))
    mask = tt.trainable(model)
    assert jax.tree.structure(mask) == jax.tree.structure(model)
    flat = dict(zip(model.flat_state_dict(), jax.tree.leaves(mask), strict=True))
    assert flat == {
        "linear.kernel": True,
        "linear.bias": True,
        "norm.scale": True,
        "norm.bias": True,
        "norm.mean": False,
        "norm.var": False,
    }
    # adamw's mask: decay only what is trained; multi_transform: freeze the rest
    for optimizer in (
        optax.adamw(1e-1, weight_decay=0.5, mask=tt.trainable),
        optax.multi_transform({True: optax.adam(1e-1), False: optax.set_to_zero()}, tt.trainable),
    ):
        state = optimizer.init(model)
        grads = jax.grad(lambda m: jnp.sum(m(x)))(model)
        assert not np.any(grads.norm.mean) and not np.any(grads.norm.var)  # no gradient
        updates, _ = optimizer.update(grads, state, model)
        new = optax.apply_updates(model, updates)
        np.testing.assert_array_equal(new.norm.mean, model.norm.mean)
        np.testing.assert_array_equal(new.norm.var, model.norm.var)
        assert not np.allclose(new.linear.kernel, model.linear.kernel)


def test_no_gradient_flows_into_untrained_fields_whatever_the_module_does():
    class Averaged(nn.Module):
        average: jax.Array = nn.field(trainable=False)
        history: list = nn.field(trainable=False)

        def __init__(self):
            self.w = jnp.ones(3)
            self.average = jnp.full(3, 2.0)
            self.history = [jnp.ones(3)]

        def __call__(self, x):
            return jnp.sum(x * self.w * self.average * self.history[0])

    m = Averaged()
    x = jnp.arange(3.0)
    for grad in (jax.grad(lambda m: m(x)), jax.jit(jax.grad(lambda m: m(x)))):
        g = grad(m)
        np.testing.assert_array_equal(g.w, 2 * x)
        assert not np.any(g.average) and not np.any(g.history[0])
    assert float(m(x)) == 6.0  # the forward pass reads the values as they are
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"cannot set Averaged\.average"):
        object.__setattr__(m, "average", jnp.zeros(3))  # past Module.__setattr__: still frozen
    assert m.average is m.__dict__["average"]  # outside a trace: the array itself
    assert jax.tree.leaves(m)[1] is m.average


def test_trainable_false_is_only_for_arrays():
    with pytest.raises(TypeError, match=r"contradicts itself"):
        nn.field(static=True, trainable=False)

    class M(nn.Module):
        n: int = nn.field(trainable=False)

    with pytest.raises(TypeError, match=r"M\.n is declared trainable=False but holds 3"):
        M(n=3)


def test_by_name_labels_a_model_for_multi_transform(optax_promotion):
    model = Classifier(3, rngs=nn.Rngs(0))
    labels = tt.by_name({"encoder.**": "frozen"}, default="train")
    tree = labels(model)
    named = dict(zip(model.flat_state_dict(), jax.tree.leaves(tree), strict=True))
    assert named["encoder.input.kernel"] == "frozen" and named["head.bias"] == "train"
    optimizer = optax.multi_transform(
        {"train": optax.sgd(1.0), "frozen": optax.set_to_zero()}, labels
    )
    state = optimizer.init(model)
    grads = jax.tree.map(jnp.ones_like, model)
    updates, _ = optimizer.update(grads, state, model)
    new = optax.apply_updates(model, updates)
    np.testing.assert_array_equal(new.encoder.input.kernel, model.encoder.input.kernel)
    np.testing.assert_allclose(new.head.bias, model.head.bias - 1.0)


def test_the_multi_transform_trap_that_by_name_avoids(optax_promotion):
    # a module is callable, so optax calls a module-shaped label tree with the parameters
    model = Classifier(3, rngs=nn.Rngs(0))
    tree = tt.by_name({"**": "train"})(model)
    optimizer = optax.multi_transform({"train": optax.sgd(1.0)}, tree)
    with pytest.raises(Exception):  # noqa: B017 - whatever the model's __call__ raises
        optimizer.init(model)
    optimizer = optax.multi_transform({"train": optax.sgd(1.0)}, tt.by_name({"**": "train"}))
    optimizer.init(model)  # the function form works


def test_by_name_rules_are_ordered_globs_over_state_names():
    model = Classifier(3, rngs=nn.Rngs(0))
    rules = [("*.bias", "bias"), ("encoder.*.kernel", "encoder kernel"), ("**", "rest")]
    named = dict(
        zip(model.flat_state_dict(), jax.tree.leaves(tt.by_name(rules)(model)), strict=True)
    )
    assert named == {
        "encoder.input.kernel": "encoder kernel",
        "encoder.input.bias": "rest",  # '*' is one part: *.bias is head.bias only
        "encoder.output.kernel": "encoder kernel",
        "encoder.output.bias": "rest",
        "head.kernel": "rest",
        "head.bias": "bias",
    }
    assert repr(tt.by_name(rules)) == (
        "by_name({'*.bias': 'bias', 'encoder.*.kernel': 'encoder kernel', '**': 'rest'})"
    )
    assert repr(tt.by_name({"a.**": 1}, default=0)) == "by_name({'a.**': 1}, default=0)"
    dtypes = tt.by_name({"head.**": jnp.float32}, default=jnp.bfloat16)(model)
    cast = jax.tree.map(lambda x, d: x.astype(d), model, dtypes)
    assert cast.head.kernel.dtype == jnp.float32 and cast.encoder.input.bias.dtype == jnp.bfloat16


def test_by_name_refuses_rules_that_match_nothing_and_names_left_unlabelled():
    model = Classifier(3, rngs=nn.Rngs(0))
    with pytest.raises(
        tt.SelectionError,
        match=r"  - 'encoder': matches no name; it matches the group 'encoder', not a "
        r"parameter: 'encoder\.\*\*' matches everything in it\.$",
    ):
        tt.by_name({"encoder": 1}, default=0)(model)
    with pytest.raises(
        ValueError, match=r"  - 'haed\.\*\*': matches no name; did you mean 'head\.\*\*'\?$"
    ):
        tt.by_name({"haed.**": 1}, default=0)(model)
    with pytest.raises(
        ValueError, match=r"  - 'encoder\.input\.kernel': no rule matches it; .* pass default="
    ):
        tt.by_name({"head.**": 1})(model)
    with pytest.raises(ValueError, match=r"'\*\*' matches whole parts"):
        tt.by_name({"enc**": 1})
    with pytest.raises(ValueError, match=r"has a '\[' without its '\]'"):
        tt.by_name({"layers.[0": 1})


@pytest.mark.parametrize("load", [tt.load_state_dict, tt.load_flat_state_dict])
def test_a_strict_load_of_any_tree_names_each_missing_leaf_and_its_call(load):
    tree = {"step": jnp.zeros((), jnp.int32), "w": {"a": jnp.ones(2)}}
    state = {"step": np.int32(1)}
    with pytest.raises(tt.StateDictError) as info:
        load(tree, state, strict=True)
    assert str(info.value) == (
        f"taktiny.{load.__name__}(dict): 1 problem; nothing was loaded.\n"
        "  - 'w.a': missing: strict=True requires every parameter; supply it, or pass "
        "strict=False to keep its current value."
    )
    loaded = load(tree, state)  # not strict: the rest keep their values
    assert int(loaded["step"]) == 1 and loaded["w"]["a"] is tree["w"]["a"]


def test_by_name_rules_must_be_pairs(without_type_checks):
    with pytest.raises(TypeError) as info:
        tt.by_name([("a", 1, 2)])
    assert str(info.value) == (
        "taktiny.by_name takes its rules as a dict {pattern: value} or a list of "
        "(pattern, value) pairs, got the entry ('a', 1, 2)."
    )


@pytest.mark.parametrize(
    ("unlabelled", "more"),
    [
        (1, ""),
        (19, ""),
        (20, "  ... and 1 more (all in .problems)"),
        (21, "  ... and 2 more (all in .problems)"),
    ],
)
def test_by_name_lists_each_unlabelled_name_and_counts_those_past_twenty(unlabelled, more):
    names = [f"p{i:02d}" for i in range(unlabelled)]
    tree = {"keep": jnp.ones(1), **{name: jnp.ones(1) for name in names}}
    with pytest.raises(tt.SelectionError) as info:
        tt.by_name({"keep": 1, "kep": 2})(tree)
    fix = (
        "no rule matches it; add a rule for it (a last rule '**' matches everything), or "
        "pass default= (the value of the names no rule matches)."
    )
    count = 1 + unlabelled
    assert str(info.value).splitlines() == [
        f"taktiny.by_name on dict: {count} problem{'s' if count > 1 else ''}:",
        "  - 'kep': matches no name; did you mean 'keep'?",
        *(f"  - {name!r}: {fix}" for name in names[:19]),
        *([more] if more else []),
    ]
    assert [(p.kind, p.name) for p in info.value.problems] == [
        ("unmatched", "kep"),
        *(("missing", name) for name in names),
    ]


def test_trainable_reaches_modules_inside_any_container():
    # a module alone in a list, an empty node (None) beside it: one flag per leaf, and the
    # untrained fields keep False however deep the module sits
    tree = {"models": [Normed(rngs=nn.Rngs(0))], "none": None, "step": jnp.zeros((), jnp.int32)}
    for _ in range(2):  # computed, then from the cache
        mask = tt.trainable(tree)
        assert jax.tree.structure(mask) == jax.tree.structure(tree)
        assert dict(zip(tt.flat_state_dict(tree), jax.tree.leaves(mask), strict=True)) == {
            "models.0.linear.kernel": True,
            "models.0.linear.bias": True,
            "models.0.norm.scale": True,
            "models.0.norm.bias": True,
            "models.0.norm.mean": False,
            "models.0.norm.var": False,
            "step": False,  # an integer: no gradient step changes it
        }


def test_the_trained_leaves_are_those_a_gradient_can_be_taken_of():
    """Partitioned by `tt.trainable`, the trained half of a tree holding an integer step
    and a PRNG key differentiates with plain ``jax.grad``: neither is marked trained."""
    import equinox as eqx

    tree = {"net": Normed(rngs=nn.Rngs(0)), "step": jnp.zeros((), jnp.int32)}
    tree["key"] = jax.random.key(0)
    flags = tt.trainable(tree)
    assert (flags["step"], flags["key"], flags["net"].linear.kernel) == (False, False, True)
    params, frozen = eqx.partition(tree, flags)
    grads = jax.grad(lambda p: jnp.sum(eqx.combine(p, frozen)["net"].linear.kernel))(params)
    assert grads["step"] is None and grads["key"] is None
    np.testing.assert_array_equal(grads["net"].linear.kernel, np.ones((3, 4)))
