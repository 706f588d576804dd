"""Deliberately broken variants of the state walk, to see each property catch the ones its
docstring names.

Nothing here changes the package: each variant monkeypatches `taktiny.state._state`,
`taktiny.state._values`, `taktiny.state._patterns` or `taktiny.arrays._eval_shape` for one pytest run, as a plugin
(pytest does not collect this file as tests). Run one variant against one property, or every
variant against the properties expected to catch it:

    PYTHONPATH=. python -m pytest -p property_tests.mutants --mutant=flat_sorted \
        --hypothesis-profile=mutants property_tests/test_round_trip.py
    PYTHONPATH=. python -m property_tests.mutants        # prints a table; exit 1 if one survives

`make test` runs every pair in-process (`property_tests/test_mutants.py`), so a property that
stops catching its variant fails the suite.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import jax
import numpy as np
from hypothesis import Phase, settings

# the ci profile without shrinking: a mutant only has to be caught, not minimised
settings.register_profile(
    "mutants", max_examples=100, derandomize=True, database=None, deadline=None,
    phases=[Phase.explicit, Phase.generate],
)  # fmt: skip


def _wrap_load(before: Any = None, after: Any = None, failed: Any = None) -> Any:
    """A `load` that edits its arguments (`before`), its result (`after`) or its error
    (`failed`)."""
    from taktiny.state import _state

    load = _state.load

    def broken(model: Any, state: Any, *, strict: bool, flat: bool, **kw: Any) -> Any:
        if before is not None:
            model, state, strict = before(model, state, strict, flat)
        try:
            result = load(model, state, strict=strict, flat=flat, **kw)
        except _state.StateDictError as error:
            if failed is None:
                raise
            return failed(model, state, error, flat)
        return result if after is None else after(model, state, result, flat)

    return broken


def _numbered(state: Any, flat: bool) -> Any:
    """`state` without the entries of lists and tuples (names with a numeric part)."""
    if flat:
        return {k: v for k, v in state.items() if not any(p.isdigit() for p in k.split("."))}
    return {
        k: _numbered(v, False) if isinstance(v, dict) else v
        for k, v in state.items()
        if not (isinstance(k, str) and k.isdigit())
    }


def _traced(tree: Any) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


def _first_problem(model: Any, state: Any, error: Any, flat: bool) -> Any:
    raise type(error)("load", list(error.problems[:1]))


def _half_applied(model: Any, state: Any, error: Any, flat: bool) -> Any:
    """Writes the values that passed the checks into the module in place, then raises."""
    bad = {p.name for p in error.problems}
    for name, value in state.items() if flat else _flat_items(state):
        *path, last = name.split(".")
        try:
            parent = model
            for part in path:
                parent = (
                    parent[int(part)]
                    if isinstance(parent, list | tuple)
                    else (parent[part] if isinstance(parent, dict) else getattr(parent, part))
                )
        except (AttributeError, KeyError, IndexError, ValueError):
            continue
        if name in bad or isinstance(parent, tuple):
            continue
        if isinstance(parent, list | dict):
            parent[int(last) if isinstance(parent, list) else last] = value
        elif hasattr(parent, last):
            object.__setattr__(parent, last, value)
    raise error


def _flat_items(state: dict, prefix: str = "") -> list:
    items = []
    for k, v in state.items():
        name = f"{prefix}{k}"
        items += _flat_items(v, name + ".") if isinstance(v, dict) else [(name, v)]
    return items


def _mutants() -> dict[str, Any]:
    """Each variant's name and the patches (module, attribute, value) it makes."""
    from taktiny.arrays import _eval_shape as _abstract
    from taktiny.module import _module
    from taktiny.sharding import _shard
    from taktiny.state import _patterns, _state, _tree, _values

    match = _patterns.match

    flat_state_dict, state_dict = _tree.flat_state_dict, _tree.state_dict
    flat_read, nested_read, convert = _tree.flat_state_dict, _tree.state_dict, _values.checked_value

    def drop_sharding(model: Any, state: Any, result: Any, flat: bool) -> Any:
        if _traced(result):
            return result
        default = jax.devices()[0]
        put = lambda x: jax.device_put(x, default) if isinstance(x, jax.Array) else x
        return jax.tree.map(put, result)

    def keep_value_sharding(model: Any, state: Any, result: Any, flat: bool) -> Any:
        given = dict(state.items() if flat else _flat_items(state))
        names = list(flat_state_dict(model))
        same = lambda v, x: isinstance(v, jax.Array) and (v.shape, v.dtype) == (x.shape, x.dtype)
        leaves = [
            given[n] if same(given.get(n), x) else x
            for n, x in zip(names, jax.tree.leaves(result), strict=True)
        ]
        return jax.tree.unflatten(jax.tree.structure(result), leaves)

    def permuted(model: Any, state: Any, result: Any, flat: bool) -> Any:
        names, leaves = list(flat_state_dict(model)), jax.tree.leaves(result)
        order = sorted(range(len(leaves)), key=lambda i: names[i])  # in string order
        return jax.tree.unflatten(jax.tree.structure(result), [leaves[i] for i in order])

    def unknown_ignored(model: Any, state: Any, strict: bool, flat: bool) -> Any:
        names = list(flat_state_dict(model))
        if flat:
            return model, {k: v for k, v in state.items() if k in names}, strict
        known = state_dict(model)

        def keep(s: dict, k: dict) -> dict:
            return {
                key: keep(v, k[key]) if isinstance(v, dict) and isinstance(k[key], dict) else v
                for key, v in s.items()
                if isinstance(key, str) and key in k
            }

        return model, keep(state, known), strict

    stop = lambda m, s, r, f: jax.tree.map(
        lambda x: jax.lax.stop_gradient(x) if isinstance(x, jax.Array) else x, r
    )
    no_strict_nested = lambda m, s, strict, flat: (m, s, strict and flat)
    no_lists = lambda m, s, strict, flat: (m, _numbered(s, flat), strict)
    no_cast_in_jit = lambda n, v, o, p: v if isinstance(v, jax.core.Tracer) else convert(n, v, o, p)
    same_kind = lambda v, o: _values.kind(np.result_type(v)) == _values.kind(o.dtype)
    no_range_check = lambda n, v, o, p: (
        np.asarray(v).astype(o.dtype) if same_kind(v, o) else convert(n, v, o, p)
    )

    def no_shape_check(name: Any, value: Any, old: Any, problems: Any) -> Any:
        array = value if isinstance(value, jax.Array) else np.asarray(value)
        same_kind = _values.kind(array.dtype) == _values.kind(old.dtype)
        if array.ndim == 2 and array.shape != old.shape and same_kind:
            return array.astype(old.dtype)  # 2-D values go through whatever their shape
        return convert(name, value, old, problems)

    def last_rule_wins(rules: Any, names: Any, default: Any) -> Any:
        found = match(rules[::-1], names, default)  # the last matching rule, not the first
        used = set(found.unused)
        return found._replace(unused=[p for p, _ in rules if p in used])

    flat_sorted = lambda m: dict(sorted(flat_read(m).items()))
    nested_sorted = lambda m: jax.tree.map(lambda x: x, nested_read(m))
    state_copies = lambda m: jax.tree.map(np.asarray, nested_read(m))
    return {
        # (Module's methods call state's functions by the names module/ imported them as)
        "flat_sorted": [
            (_tree, "flat_state_dict", flat_sorted),
            (_module, "tree_flat_state_dict", flat_sorted),
        ],
        "nested_sorted": [
            (_tree, "state_dict", nested_sorted),
            (_module, "tree_state_dict", nested_sorted),
        ],
        "state_copies": [
            (_tree, "state_dict", state_copies),
            (_module, "tree_state_dict", state_copies),
        ],
        "lists_ignored": [(_state, "load", _wrap_load(before=no_lists))],
        "drop_sharding": [(_state, "load", _wrap_load(after=drop_sharding))],
        "keep_value_sharding": [(_state, "load", _wrap_load(after=keep_value_sharding))],
        "permuted": [(_state, "load", _wrap_load(after=permuted))],
        "first_problem_only": [(_state, "load", _wrap_load(failed=_first_problem))],
        "half_applied": [(_state, "load", _wrap_load(failed=_half_applied))],
        "unknown_ignored": [(_state, "load", _wrap_load(before=unknown_ignored))],
        "strict_ignored_nested": [(_state, "load", _wrap_load(before=no_strict_nested))],
        "stop_gradient": [(_state, "load", _wrap_load(after=stop))],
        "no_cast_in_jit": [(_values, "checked_value", no_cast_in_jit)],
        "no_range_check": [(_values, "checked_value", no_range_check)],
        "no_shape_check": [(_values, "checked_value", no_shape_check)],
        # (tt.shard calls the name sharding/ imported from state's face)
        "last_rule_wins": [(_patterns, "match", last_rule_wins), (_shard, "match", last_rule_wins)],
        "eval_shape_ignores_mesh": [(_abstract, "_meshes", lambda leaves: [])],
    }


# Which properties each variant is expected to fail (file::test, without the platform).
EXPECTED = {
    "flat_sorted": ["test_round_trip.py::test_nested_and_flat_states_describe_the_same_leaves"],
    "nested_sorted": ["test_round_trip.py::test_nested_and_flat_states_describe_the_same_leaves"],
    "state_copies": ["test_round_trip.py::test_nested_and_flat_states_describe_the_same_leaves"],
    "lists_ignored": [
        "test_partial.py::test_partial_load_changes_exactly_the_supplied_leaves",
        "test_sharding.py::test_loading_onto_another_placement_reshards_with_equal_values",
        "test_orbax.py::test_orbax_round_trip_is_bitwise_onto_the_targets_shardings",
    ],
    "drop_sharding": [
        "test_round_trip.py::test_own_state_loads_back_to_an_equal_module",
        "test_partial.py::test_partial_load_changes_exactly_the_supplied_leaves",
        "test_sharding.py::test_loading_onto_another_placement_reshards_with_equal_values",
        "test_sharding.py::test_host_values_load_onto_the_shardings_of_the_leaves_they_replace",
        "test_orbax.py::test_orbax_round_trip_is_bitwise_onto_the_targets_shardings",
        "test_orbax.py::test_orbax_restores_onto_an_abstract_target_sharded_on_another_mesh",
    ],
    "keep_value_sharding": [
        "test_partial.py::test_partial_load_changes_exactly_the_supplied_leaves",
        "test_sharding.py::test_loading_onto_another_placement_reshards_with_equal_values",
    ],
    "permuted": [
        "test_round_trip.py::test_own_state_loads_back_to_an_equal_module",
        "test_transforms.py::test_gradients_through_a_load_equal_those_of_the_model",
    ],
    "first_problem_only": [
        "test_errors.py::test_strict_load_fails_exactly_when_a_leaf_is_missing",
        "test_errors.py::test_unknown_keys_always_fail_and_are_all_listed",
        "test_errors.py::test_bad_values_are_all_listed_and_nothing_is_loaded",
    ],
    "half_applied": ["test_errors.py::test_bad_values_are_all_listed_and_nothing_is_loaded"],
    "unknown_ignored": ["test_errors.py::test_unknown_keys_always_fail_and_are_all_listed"],
    "strict_ignored_nested": [
        "test_errors.py::test_strict_load_fails_exactly_when_a_leaf_is_missing",
        "test_errors.py::test_unknown_keys_always_fail_and_are_all_listed",
    ],
    "stop_gradient": ["test_transforms.py::test_gradients_through_a_load_equal_those_of_the_model"],
    "no_cast_in_jit": ["test_transforms.py::test_loading_inside_jit_equals_loading_outside"],
    "no_range_check": ["test_errors.py::test_bad_values_are_all_listed_and_nothing_is_loaded"],
    "no_shape_check": ["test_errors.py::test_bad_values_are_all_listed_and_nothing_is_loaded"],
    "last_rule_wins": ["test_sharding.py::test_shard_places_each_leaf_by_its_first_matching_rule"],
    "eval_shape_ignores_mesh": [
        "test_sharding.py::"
        "test_optimizer_state_of_an_abstract_sharded_model_is_sharded_like_its_parameters"
    ],
}


def pytest_addoption(parser: Any) -> None:
    parser.addoption(
        "--mutant", default=None, help="a broken variant of taktiny.state._state to run"
    )


def pytest_sessionstart(session: Any) -> None:
    name = session.config.getoption("--mutant")
    if name:
        for module, attr, value in _mutants()[name]:
            setattr(module, attr, value)


def main() -> int:
    """Runs every variant against its properties; 1 if a variant survives one of them."""
    survived = 0
    for name, tests in EXPECTED.items():
        for test in tests:
            command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "property_tests.mutants"]
            command += [
                f"--mutant={name}",
                "--hypothesis-profile=mutants",
                "-p",
                "no:cacheprovider",
            ]
            run = subprocess.run(
                [*command, f"property_tests/{test}[cpu]"], capture_output=True, text=True
            )
            caught = run.returncode == 1 and "1 failed" in run.stdout
            survived += not caught
            # the first error line, to see that the property's own check failed
            why = next(
                (line[1:].strip() for line in run.stdout.splitlines() if line[:2] == "E "), ""
            )
            print(f"{name:22} {'caught' if caught else 'SURVIVED':9} {test}\n    {why[:110]}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
