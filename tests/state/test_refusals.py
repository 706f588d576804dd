"""Values a load refuses rather than load wrong: casts that would overflow a float without
inf, tracers leaked out of finished transformations, deleted arrays, NumPy masked arrays,
and states that contain themselves or nest deeper than the tree. Each is one
`StateDictError` problem naming the key (its exact message is in test_problems.py)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import MLP, Scaled

import taktiny as tt
from taktiny import nn
from taktiny.state import _state


@pytest.fixture(autouse=True, params=["walk", "flat"])
def view(request, monkeypatch):
    """Every test here runs twice: loads that walk to the leaves they name, and loads that
    flatten the whole tree."""
    monkeypatch.setattr(_state, "WALK_LIMIT", 10**9 if request.param == "walk" else -1)
    return request.param


class Holder(nn.Module):
    w: jax.Array


def refused(kind, key, match, load):
    """Runs `load`, which must raise one problem of `kind` about `key`, matching `match`."""
    with pytest.raises(tt.StateDictError, match=match) as info:
        load()
    assert [(p.kind, p.name) for p in info.value.problems] == [(kind, key)]


# --- floats without inf ---------------------------------------------------------------

NO_INF = [  # (dtype, its largest, a value just past it that rounds back to it, what it makes)
    (jnp.float8_e4m3fn, 448.0, 460.0, "nan"),
    (jnp.float8_e4m3fnuz, 240.0, 247.0, "nan"),
    (jnp.float8_e5m2fnuz, 57344.0, 59000.0, "nan"),
    (jnp.float8_e4m3b11fnuz, 30.0, 30.9, "nan"),
    (jnp.float4_e2m1fn, 6.0, 6.9, "clip"),
]


@pytest.mark.parametrize("where", ["numpy", "jax"])
@pytest.mark.parametrize("dtype, largest, rounds, makes", NO_INF)
def test_finite_values_too_large_for_a_float_without_inf_are_refused(
    where, dtype, largest, rounds, makes
):
    make = jnp.asarray if where == "jax" else np.asarray
    h = Holder(jnp.zeros(3, dtype))
    name = np.dtype(dtype).name
    change = "turn {} into nan" if makes == "nan" else "clip {} to its largest"
    for values, count in (
        ([1.0, largest * 4, 0.5], "a value"),
        ([-largest * 4, largest * 2, 1], "2 values"),
    ):
        refused(
            "dtype",
            "w",
            re.escape(f"'w': casting float32 to {name} would {change.format(count)}")
            + ".*"
            + re.escape(
                f": the largest is {largest * 4:.4g}, and {name} holds at most {largest:.4g} "
                f"and has no inf."
            ),
            lambda values=values: h.load_state_dict({"w": make(np.array(values, np.float32))}),
        )
    # a value past the largest that rounds to it loads as it; NaN already there stays NaN
    loaded = h.load_state_dict({"w": make(np.array([rounds, -largest, np.nan], np.float32))})
    assert loaded.w.dtype == dtype
    np.testing.assert_array_equal(np.asarray(loaded.w[:2], np.float32), [largest, -largest])
    if makes == "nan":  # (float4_e2m1fn has no NaN to keep)
        assert np.isnan(np.asarray(loaded.w[2], np.float32))


@pytest.mark.parametrize("where", ["numpy", "jax"])
def test_a_float_that_clips_refuses_exactly_the_values_past_its_largest_and_half_a_step(where):
    """float4_e2m1fn clips what is past its largest, 6, plus half the step below it (2
    there): 7 itself rounds (a tie) to 6 and loads, the next float32 up is refused."""
    make = jnp.asarray if where == "jax" else np.asarray
    h = Holder(jnp.zeros(2, jnp.float4_e2m1fn))
    loaded = h.load_state_dict({"w": make(np.array([7.0, -7.0], np.float32))})
    assert np.asarray(loaded.w, np.float32).tolist() == [6.0, -6.0]
    past = np.nextafter(np.float32(7.0), np.float32(np.inf))
    refused(
        "dtype",
        "w",
        re.escape("'w': casting float32 to float4_e2m1fn would clip a value to its largest"),
        lambda: h.load_state_dict({"w": make(np.array([past, 0.0], np.float32))}),
    )


@pytest.mark.parametrize("where", ["numpy", "jax"])
@pytest.mark.parametrize("source", [jnp.float8_e4m3fn, jnp.bfloat16, jnp.float16])
def test_a_narrow_float_source_into_a_clipping_float_is_checked_as_any_other(where, source):
    """The clip check compares in float32, which holds every value and the limit: a JAX
    float8 or bfloat16 source (JAX compares no float8 with a typed float64 scalar) is
    refused past the limit, and loads up to it, as a float32 one is."""
    make = jnp.asarray if where == "jax" else np.asarray
    h = Holder(jnp.zeros(2, jnp.float4_e2m1fn))
    name = np.dtype(source).name
    loaded = h.load_state_dict({"w": make(np.array([7.0, -6.0], np.float32)).astype(source)})
    assert np.asarray(loaded.w, np.float32).tolist() == [6.0, -6.0]
    refused(
        "dtype",
        "w",
        re.escape(f"'w': casting {name} to float4_e2m1fn would clip a value to its largest"),
        lambda: h.load_state_dict({"w": make(np.array([8.0, 0.0], np.float32)).astype(source)}),
    )


def test_a_float6_value_is_checked_against_half_the_step_below_its_largest():
    """float6_e2m3fn (largest 7.5, in steps of 0.5 there) clips past 7.75. JAX cannot place
    it, but the values for a NumPy leaf of it are checked first: with an unknown key as
    well, nothing loads, and the problems show that 7.7 would round and 7.8 clip."""
    import ml_dtypes

    tree = {"w": np.zeros(1, ml_dtypes.float6_e2m3fn)}
    for value, kinds in ((7.7, [("unknown", "u")]), (7.8, [("unknown", "u"), ("dtype", "w")])):
        state = {"w": np.array([value], np.float32), "u": np.zeros(1, np.float32)}
        with pytest.raises(tt.StateDictError) as info:
            tt.load_state_dict(tree, state)
        assert [(p.kind, p.name) for p in info.value.problems] == kinds


@pytest.mark.parametrize("where", ["numpy", "jax"])
@pytest.mark.parametrize(
    "dtype, largest, tie",
    [(jnp.float8_e4m3fnuz, 240.0, 248.0), (jnp.float8_e5m2fnuz, 57344.0, 61440.0)],
)
def test_a_tie_past_the_largest_that_rounds_to_nan_is_refused(where, dtype, largest, tie):
    """Largest plus half a step, in a float whose largest has an odd last bit: the tie
    rounds up, past the largest, to NaN; refused, as any value that becomes NaN."""
    make = jnp.asarray if where == "jax" else np.asarray
    h = Holder(jnp.zeros(2, dtype))
    name = np.dtype(dtype).name
    refused(
        "dtype",
        "w",
        re.escape(f"'w': casting float32 to {name} would turn a value into nan")
        + ".*"
        + re.escape(f": the largest is {tie:.4g}, and {name} holds at most {largest:.4g}"),
        lambda: h.load_state_dict({"w": make(np.array([tie, 1.0], np.float32))}),
    )


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float4_e2m1fn])
def test_infinities_into_a_float_without_inf_are_refused(dtype):
    h = Holder(jnp.zeros(2, dtype))
    refused(
        "dtype",
        "w",
        r"'w': casting float32 to .* the largest is inf, and .* has no inf",
        lambda: h.load_state_dict({"w": np.array([1.0, -np.inf], np.float32)}),
    )


def test_floats_with_inf_keep_their_rule():
    # float8_e5m2 has inf: a finite value too large is refused as inf, an inf loads as inf
    h = Holder(jnp.zeros(2, jnp.float8_e5m2))
    refused(
        "dtype",
        "w",
        r"'w': casting float32 to float8_e5m2 would turn a value into inf",
        lambda: h.load_state_dict({"w": np.array([1e6, 1.0], np.float32)}),
    )
    loaded = h.load_state_dict({"w": np.array([np.inf, 1.0], np.float32)})
    assert np.isinf(np.asarray(loaded.w[0], np.float32))


# --- tracers that belong to no transformation being traced ------------------------------


def _leak(kind):
    """A float32[4] tracer left over from a finished transformation of `kind`."""
    out = []
    keep = lambda x: out.append(x) or x
    if kind == "jit":
        jax.jit(keep)(jnp.zeros(4))
    elif kind == "vmap":
        jax.vmap(keep)(jnp.zeros((3, 4)))
    elif kind == "grad":
        jax.grad(lambda x: keep(x).sum())(jnp.zeros(4))
    else:
        jax.make_jaxpr(keep)(jnp.zeros(4))
    return out[0]


@pytest.mark.parametrize("flat", [True, False])
@pytest.mark.parametrize("kind", ["jit", "vmap", "grad", "make_jaxpr"])
def test_a_tracer_leaked_out_of_a_finished_transformation_is_refused(kind, flat):
    m = MLP(rngs=nn.Rngs(0))
    tracer = _leak(kind)
    assert isinstance(tracer, jax.core.Tracer)
    state = {"output.bias": tracer} if flat else {"output": {"bias": tracer}}
    load = m.load_flat_state_dict if flat else m.load_state_dict
    refused(
        "value",
        "output.bias",
        r"'output\.bias': expected an array, got a tracer float32\[4\] \(\w+Tracer\) that "
        r"belongs to no transformation being traced now: it leaked out of",
        lambda: load(state),
    )
    # so is one among every leaf, in order (the full load's own path)
    every = {**m.flat_state_dict(), "output.bias": tracer}
    refused(
        "value", "output.bias", r"'output\.bias': .* leaked", lambda: m.load_flat_state_dict(every)
    )


def test_a_tracer_leaked_from_a_finished_vmap_is_refused_inside_jit():
    m = MLP(rngs=nn.Rngs(0))
    tracer = _leak("vmap")
    refused(
        "value",
        "output.bias",
        r"'output\.bias': expected an array, got a tracer .* \(BatchTracer\)",
        lambda: jax.jit(lambda m: m.load_flat_state_dict({"output.bias": tracer}))(m),
    )


def test_live_tracers_load_inside_the_transformations_they_belong_to():
    m = MLP(rngs=nn.Rngs(0))
    x = jnp.ones((2, 32))

    @jax.jit
    def outer(m, bias):  # the current jit's own tracer
        loaded = m.load_flat_state_dict({"output.bias": bias})
        # and one of the enclosing jit, closed over by a vmap inside it
        inner = jax.vmap(lambda row: m.load_flat_state_dict({"output.bias": bias})(row))(x)
        return loaded(x), inner

    bias = jnp.arange(4.0)
    out, inner = outer(m, bias)
    want = m.load_flat_state_dict({"output.bias": bias})(x)
    np.testing.assert_allclose(out, want)
    np.testing.assert_allclose(inner, want)
    # and grad through a load
    grad = jax.grad(lambda b: m.load_flat_state_dict({"output.bias": b})(x).sum())(bias)
    np.testing.assert_allclose(grad, jnp.full(4, 2.0))


# --- deleted arrays ---------------------------------------------------------------------


def _donated():
    x = jnp.ones(4)
    jax.jit(lambda a: a * 2, donate_argnums=0)(x)
    return x


@pytest.mark.parametrize("how", ["delete", "donate"])
def test_a_deleted_array_is_refused(how):
    m = MLP(rngs=nn.Rngs(0))
    if how == "delete":
        x = jnp.ones(4)
        x.delete()
    else:
        x = _donated()
    assert x.is_deleted()
    message = r"'output\.bias': expected an array, got a deleted array float32\[4\]"
    refused("value", "output.bias", message, lambda: m.load_flat_state_dict({"output.bias": x}))
    refused("value", "output.bias", message, lambda: m.load_state_dict({"output": {"bias": x}}))
    # among every leaf, in order: the full load's path, which keeps the arrays it is given
    every = {**m.flat_state_dict(), "output.bias": x}
    refused("value", "output.bias", message, lambda: m.load_flat_state_dict(every))
    other = MLP(rngs=nn.Rngs(1)).state_dict()
    other["output"]["bias"] = x
    refused("value", "output.bias", message, lambda: m.load_state_dict(other, strict=True))
    # one that a load would cast (another dtype) or move (another device) first
    half = jnp.ones(4, jnp.bfloat16)
    half.delete()
    elsewhere = jax.device_put(jnp.ones(4), jax.devices("cpu")[1])
    elsewhere.delete()
    for value in (half, elsewhere):
        refused(
            "value",
            "output.bias",
            r"'output\.bias': expected an array, got a deleted array",
            lambda value=value: m.load_flat_state_dict({"output.bias": value}),
        )


# --- NumPy masked arrays ----------------------------------------------------------------


@pytest.mark.parametrize("mask", [[True, False, False, False], False])
def test_a_masked_array_is_refused_with_how_to_unmask_it(mask):
    m = MLP(rngs=nn.Rngs(0))
    masked = np.ma.masked_array(np.ones(4, np.float32), mask=mask)
    refused(
        "value",
        "output.bias",
        r"'output\.bias': expected a plain array, got a NumPy masked array float32\[4\] with "
        rf"{int(np.ma.count_masked(masked))} masked of 4: .* value\.filled\(fill\) .* value\.data",
        lambda: m.load_flat_state_dict({"output.bias": masked}),
    )
    loaded = m.load_flat_state_dict({"output.bias": masked.filled(0.0)})
    np.testing.assert_array_equal(loaded.output.bias, [0, 1, 1, 1] if mask else [1] * 4)


# --- states that contain themselves, or nest deeper than the tree ----------------------


class Deep(nn.Module):
    def __init__(self):
        self.encoder = {"block": MLP(rngs=nn.Rngs(0))}


class Dense(nn.Module):
    def __init__(self):
        self.kernel = Scaled(jnp.ones((2, 3), jnp.int8), jnp.full((3,), 0.5))


def nested(depth, leaf):
    state = leaf
    for _ in range(depth):
        state = {"a": state}
    return state


@pytest.mark.parametrize("strict", [False, True])
def test_a_state_that_contains_itself_is_refused_where_it_does(strict):
    d = Deep()
    root = {}
    root["encoder"] = root  # at the top
    below = {"encoder": {"block": {}}}
    below["encoder"]["block"]["input"] = below["encoder"]  # further down
    for state, key, got in [
        (root, "encoder", "the whole state"),
        (below, "encoder.block.input", "the dict at 'encoder'"),
    ]:
        message = f"'{key}': its value is {got}, which contains it: a state that contains itself"
        with pytest.raises(tt.StateDictError, match=re.escape(message)) as info:
            d.load_state_dict(state, strict=strict)
        problems = [(p.kind, p.name) for p in info.value.problems]
        assert problems[0] == ("structure", key)
        assert {kind for kind, _ in problems[1:]} == ({"missing"} if strict else set())
    leaf = {}
    leaf["kernel"] = leaf  # where an array belongs
    refused(
        "structure",
        "encoder.block.input.kernel",
        r"'encoder\.block\.input\.kernel': expected an array, got a dict with keys \['kernel'\]",
        lambda: d.load_state_dict({"encoder": {"block": {"input": leaf}}}),
    )
    flat = {}
    flat["x"] = flat
    refused(
        "structure",
        "encoder.block.input.bias",
        r"'encoder\.block\.input\.bias': expected an array, got a dict with keys \['x'\]",
        lambda: d.load_flat_state_dict({"encoder.block.input.bias": flat}),
    )


def test_a_state_deeper_than_the_tree_is_refused_where_it_goes_too_deep():
    d = Deep()
    deep = nested(5000, np.zeros(64, np.float32))  # far past Python's recursion limit
    refused(
        "structure",
        "encoder.block.input.bias",
        r"'encoder\.block\.input\.bias': expected an array, got a dict with keys \['a'\]",
        lambda: d.load_state_dict({"encoder": {"block": {"input": {"bias": deep}}}}),
    )
    refused(
        "unknown",
        "a",
        r"'a': unknown key",
        lambda: d.load_state_dict(deep),
    )
    refused(
        "unknown",
        "encoder.block.a",
        r"'encoder\.block\.a': unknown key",
        lambda: d.load_state_dict({"encoder": {"block": deep}}, strict=False),
    )


def test_a_custom_parameter_given_a_value_that_contains_itself_is_refused():
    dense = Dense()
    inside = []
    inside.append(inside)
    refused(
        "structure",
        "kernel",
        r"'kernel': got a value of type list nested too deeply to be read",
        lambda: dense.load_state_dict({"kernel": inside}),
    )
    parts = {}
    parts["zzz"] = parts  # a dict of parts that contains itself
    refused(
        "unknown",
        "kernel.zzz",
        r"'kernel\.zzz': unknown key; this parameter's parts are \['value', 'scale'\]",
        lambda: dense.load_state_dict({"kernel": parts}),
    )
    refused(
        "structure",
        "kernel.value",
        r"'kernel\.value': expected an array, got a dict with keys \['a'\]",
        lambda: dense.load_state_dict({"kernel": {"value": nested(5000, 1)}}),
    )
