"""Custom PyTree parameter values (a quantized weight, say): whole in the nested state,
flattened to arrays in the flat state, and loadable in both forms."""

import jax.numpy as jnp
import numpy as np
import pytest
from _models import Scaled

import taktiny as tt
from taktiny import nn


class Dense(nn.Module):
    def __init__(self):
        self.kernel = Scaled(jnp.ones((2, 3), jnp.int8), jnp.full((3,), 0.5))
        self.bias = jnp.zeros(3)


def test_nested_keeps_the_value_whole_and_flat_flattens_it():
    m = Dense()
    state = m.state_dict()
    assert isinstance(state["kernel"], Scaled) and state["kernel"].value is m.kernel.value
    assert list(m.flat_state_dict()) == ["kernel.value", "kernel.scale", "bias"]


def test_both_forms_load():
    m = Dense()
    new_kernel = Scaled(jnp.full((2, 3), 3, jnp.int8), jnp.full((3,), 2.0))
    loaded = m.load_state_dict({"kernel": new_kernel})
    assert loaded.kernel.value is new_kernel.value and loaded.bias is m.bias
    flat = m.load_flat_state_dict({"kernel.scale": np.ones(3, np.float32)})
    np.testing.assert_array_equal(flat.kernel.scale, [1.0, 1.0, 1.0])
    assert flat.kernel.value is m.kernel.value


def test_wrong_structure_for_a_custom_value_is_an_error():
    m = Dense()
    with pytest.raises(tt.StateDictError, match=r"'kernel': expected a value structured as"):
        m.load_state_dict({"kernel": jnp.ones((2, 3))})
    with pytest.raises(tt.StateDictError, match=r"'kernel\.value': dtype kind changes"):
        m.load_state_dict({"kernel": Scaled(jnp.ones((2, 3)), jnp.ones(3))})


def test_a_dict_of_the_parts_loads_too():
    # what Orbax gives back for a custom parameter restored without a target
    m = Dense()
    parts = {"value": np.full((2, 3), 2, np.int8), "scale": [1.0, 2.0, 3.0]}
    loaded = m.load_state_dict({"kernel": parts})
    assert isinstance(loaded.kernel, Scaled) and int(loaded.kernel.value[0, 0]) == 2
    np.testing.assert_array_equal(loaded.kernel.scale, [1.0, 2.0, 3.0])
    assert loaded.bias is m.bias
    with pytest.raises(
        tt.StateDictError,
        match=r"'kernel\.zero_point': unknown key; this parameter's parts are \['value', 'scale'\]",
    ):
        m.load_state_dict({"kernel": {"zero_point": np.zeros(3)}})


def test_both_views_load_custom_parameters(monkeypatch):
    # a load naming many leaves (or strict) flattens the model; one naming few walks to them:
    # custom parameters load the same either way, whole or by their parts
    from taktiny.state import _state

    m = Dense()
    parts = {"value": np.full((2, 3), 4, np.int8), "scale": np.full(3, 0.25, np.float32)}
    for limit in (-1, 10**9):
        monkeypatch.setattr(_state, "WALK_LIMIT", limit)
        whole = m.load_state_dict({"kernel": Scaled(*parts.values()), "bias": np.ones(3)})
        by_parts = m.load_state_dict({"kernel": parts, "bias": np.ones(3)}, strict=True)
        flat = m.load_flat_state_dict(
            {"kernel.value": parts["value"], "kernel.scale": parts["scale"]}
        )
        for loaded in (whole, by_parts, flat):
            assert isinstance(loaded.kernel, Scaled) and loaded.kernel.value.dtype == jnp.int8
            np.testing.assert_array_equal(loaded.kernel.value, parts["value"])
            np.testing.assert_array_equal(loaded.kernel.scale, parts["scale"])
        with pytest.raises(tt.StateDictError, match=r"'kernel\.value': dtype kind changes"):
            m.load_state_dict({"kernel": {"value": np.zeros((2, 3), np.float32)}})


class Nested(nn.Module):
    """A custom parameter inside another: its leaves are named 'kernel.value.value' and so
    on, parts of no QArray."""

    def __init__(self):
        self.kernel = Scaled(Scaled(jnp.ones((2, 3), jnp.int8), jnp.ones(3)), jnp.ones(3))


def test_a_problem_inside_a_nested_custom_parameter_names_its_leaf():
    m = Nested()
    assert list(m.flat_state_dict()) == ["kernel.value.value", "kernel.value.scale", "kernel.scale"]
    state = m.flat_state_dict() | {"kernel.value.value": np.ones((2, 2), np.int8)}
    with pytest.raises(tt.StateDictError) as raised:
        m.load_flat_state_dict(state, strict=True)
    assert str(raised.value) == (
        "Nested.load_flat_state_dict(): 1 problem; nothing was loaded.\n"
        "  - 'kernel.value.value': shape mismatch: expected (2, 3), got (2, 2)."
    )
