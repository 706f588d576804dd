"""`taktiny.convert`: rules from PyTorch names to Taktiny's, coverage, export, round trips."""

import re
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _torch import assert_close, numpy, randomize_

import taktiny as tt
from taktiny import convert as cv
from taktiny import nn

MLP_RULES = [
    cv.Rule("{i}.weight", "layers.{i}.kernel", cv.transpose()),
    cv.Rule("{i}.bias", "layers.{i}.bias"),
]


def torch_mlp() -> torch.nn.Sequential:
    return randomize_(
        torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    )


def mlp() -> nn.Sequential:
    rngs = nn.Rngs(0)
    exact = {"precision": "highest", "rngs": rngs}  # compared with torch's float32
    return nn.Sequential(nn.Linear(4, 8, **exact), jax.nn.relu, nn.Linear(8, 3, **exact))


class QKV(nn.Module):
    def __init__(self, features: int, *, rngs: nn.Rngs):
        exact = {"precision": "highest", "rngs": rngs}  # compared with torch's float32
        self.query = nn.Linear(features, features, **exact)
        self.key = nn.Linear(features, features, **exact)
        self.value = nn.Linear(features, features, **exact)


QKV_RULES = [
    cv.Rule("qkv.weight", [f"{p}.kernel" for p in ("query", "key", "value")],
            cv.chain(cv.split(axis=0), cv.transpose())),
    cv.Rule("qkv.bias", [f"{p}.bias" for p in ("query", "key", "value")], cv.split(axis=0)),
]  # fmt: skip


class Stacked(nn.Module):
    def __init__(self, layers: int, features: int):
        self.kernel = jnp.zeros((layers, features, features))
        self.bias = jnp.zeros((layers, features))


def torch_state(module: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: numpy(t) for name, t in module.state_dict().items()}


def test_converts_a_torch_mlp_to_the_same_function():
    theirs = torch_mlp()
    flat = cv.convert(MLP_RULES, theirs.state_dict(), target=mlp())  # torch tensors in
    assert list(flat) == ["layers.0.kernel", "layers.0.bias", "layers.2.kernel", "layers.2.bias"]
    ours = mlp().load_flat_state_dict(flat, strict=True)
    x = np.random.default_rng(0).standard_normal((5, 4), dtype=np.float32)
    assert_close(ours(jnp.asarray(x)), numpy(theirs(torch.from_numpy(x))))


TORCH_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.int8,
                torch.uint8, torch.int16, torch.int32, torch.bool]  # fmt: skip


def bits(t: torch.Tensor) -> np.ndarray:
    """The raw bits of a torch tensor, as unsigned integers of its width (bool as itself)."""
    if t.dtype == torch.bool:
        return t.numpy()
    unsigned = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.view(unsigned).numpy().view(f"u{t.element_size()}")


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_converts_torch_tensors_of_every_dtype_bit_for_bit(dtype):
    generator = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        tensor = (torch.randn(2, 3, generator=generator) * 8).to(dtype)
    else:
        tensor = torch.randint(0, 2 if dtype == torch.bool else 100, (2, 3), generator=generator)
        tensor = tensor.to(dtype)
    name = str(dtype).removeprefix("torch.")
    target = {"kernel": jax.ShapeDtypeStruct((3, 2), jnp.dtype(name)), "bias": jnp.zeros(2)}
    rules = [cv.Rule("w", "kernel", cv.transpose()), cv.Rule("b", "bias")]
    source = {"w": tensor, "b": torch.ones(2, requires_grad=True)}  # (one that needs grad)
    report = cv.check(rules, source, target=target)
    assert [step.sources for step in report.steps] == [("w",), ("b",)]
    flat = cv.convert(rules, source, target=target)
    kernel = np.asarray(flat["kernel"])
    assert kernel.dtype == jnp.dtype(name) and kernel.shape == (3, 2)
    expected = bits(tensor.T.contiguous())
    np.testing.assert_array_equal(kernel.view(expected.dtype), expected)
    np.testing.assert_array_equal(flat["bias"], np.ones(2, np.float32))
    # and the tensor itself, as load_flat_state_dict takes it
    leaves = {"w": jnp.zeros((2, 3), jnp.dtype(name))}
    loaded = tt.load_flat_state_dict(leaves, {"w": tensor}, strict=True)
    expected = bits(tensor)
    np.testing.assert_array_equal(np.asarray(loaded["w"]).view(expected.dtype), expected)


def test_splits_a_fused_qkv_and_exports_it_back():
    fused = randomize_(torch.nn.Linear(4, 12))
    source = {f"qkv.{name}": value for name, value in torch_state(fused).items()}
    ours = QKV(4, rngs=nn.Rngs(0)).load_flat_state_dict(
        cv.convert(QKV_RULES, source, target=QKV(4, rngs=nn.Rngs(1))), strict=True
    )
    x = np.random.default_rng(1).standard_normal((2, 4), dtype=np.float32)
    q, k, v = np.split(numpy(fused(torch.from_numpy(x))), 3, axis=-1)
    for layer, expected in ((ours.query, q), (ours.key, k), (ours.value, v)):
        assert_close(layer(jnp.asarray(x)), expected)
    exported = cv.export(QKV_RULES, ours)
    assert sorted(exported) == sorted(source)
    for name, value in source.items():
        np.testing.assert_array_equal(exported[name], value)
    cv.round_trip_check(QKV_RULES, ours)


STACK_RULES = [
    cv.Rule("layers.{i}.weight", "kernel", cv.chain(cv.transpose(), cv.stack(axis=0))),
    cv.Rule("layers.{i}.bias", "bias", cv.stack(axis=0)),
]


def test_stacks_per_layer_tensors_in_index_order_and_unstacks_them():
    layers = [randomize_(torch.nn.Linear(3, 3), seed=s) for s in range(11)]
    source = {f"layers.{i}.{n}": v for i, m in enumerate(layers) for n, v in torch_state(m).items()}
    shuffled = dict(sorted(source.items()))  # "layers.10" before "layers.2"
    flat = cv.convert(STACK_RULES, shuffled, target=Stacked(11, 3))
    assert flat["kernel"].shape == (11, 3, 3)
    for i, layer in enumerate(layers):
        np.testing.assert_array_equal(flat["kernel"][i], numpy(layer.weight).T)
        np.testing.assert_array_equal(flat["bias"][i], numpy(layer.bias))
    model = Stacked(11, 3).load_flat_state_dict(flat, strict=True)
    exported = cv.export(STACK_RULES, model)
    assert sorted(exported) == sorted(source)
    for name, value in source.items():
        np.testing.assert_array_equal(exported[name], value)
    cv.round_trip_check(STACK_RULES, model)


def test_a_gathering_rule_exports_under_its_other_captures_and_needs_its_sizes():
    """Gathered over {i} within each {b}: export names each part with both captures; a
    gathered concatenate has no count of parts to split back into without its sizes."""
    rule = cv.Rule("blocks.{b}.layers.{i}.w", "blocks.{b}.w", cv.stack(axis=0))
    model = {f"blocks.{b}.w": np.arange(6, dtype=np.float32).reshape(3, 2) + b for b in (0, 1)}
    exported = cv.export([rule], model)
    assert sorted(exported) == [f"blocks.{b}.layers.{i}.w" for b in (0, 1) for i in range(3)]
    np.testing.assert_array_equal(exported["blocks.1.layers.2.w"], [5.0, 6.0])
    joined = cv.Rule("layers.{i}.w", "w", cv.concatenate(0))
    with pytest.raises(ValueError, match=r"^split\(axis=0\) needs its sizes here: the number "
                       r"of parts is not known$"):  # fmt: skip
        cv.export([joined], {"w": np.zeros(4, np.float32)})
    # an inverse that makes more arrays than the rule has sources never drops one silently
    three = cv.Rule(["a", "b"], "w", cv.concatenate(0, sizes=(1, 1, 2)))
    with pytest.raises(ValueError, match=r"zip\(\) argument 2 is longer than argument 1"):
        cv.export([three], {"w": np.zeros(4, np.float32)})
    sized = cv.Rule("layers.{i}.w", "w", cv.concatenate(0, sizes=(1, 3)))
    assert sorted(cv.export([sized], {"w": np.zeros(4, np.float32)})) == [
        "layers.0.w",
        "layers.1.w",
    ]


def test_a_transform_is_told_how_many_arrays_its_rule_wants_none_when_gathering():
    class counted(cv.Transform):  # stacks what it reads, then records the count it was told
        def __init__(self):
            self.counts = []

        def __call__(self, arrays: tuple[Any, ...], count: int | None = None) -> tuple[Any, ...]:
            self.counts.append(count)
            return (jnp.stack(arrays),)

    gathering, one = counted(), counted()
    rules = [cv.Rule("layers.{i}.w", "w", gathering), cv.Rule("b", "b", one)]
    source = {"layers.0.w": np.ones(2, np.float32), "layers.1.w": np.ones(2, np.float32),
              "b": np.ones(2, np.float32)}  # fmt: skip
    flat = cv.convert(rules, source, target={"w": np.ones((2, 2)), "b": np.ones((1, 2))})
    assert flat["w"].shape == (2, 2) and flat["b"].shape == (1, 2)
    assert gathering.counts == [None, None] and one.counts == [1, 1]  # checked, then made


def test_concatenates_separate_projections_and_splits_them_back():
    rules = [
        cv.Rule(["q.{x}", "k.{x}", "v.{x}"], "{x}", cv.concatenate(axis=-1)),
    ]
    rng = np.random.default_rng(2)
    source = {f"{p}.{x}": rng.standard_normal((2, 3), dtype=np.float32)
              for p in "qkv" for x in ("kernel", "bias")}  # fmt: skip
    target = {"kernel": jax.ShapeDtypeStruct((2, 9), jnp.float32),
              "bias": jax.ShapeDtypeStruct((2, 9), jnp.float32)}  # fmt: skip
    flat = cv.convert(rules, source, target=target)
    np.testing.assert_array_equal(flat["kernel"][:, 3:6], source["k.kernel"])
    model = Stacked(1, 3).replace(kernel=jnp.asarray(flat["kernel"]), bias=flat["bias"])
    exported = cv.export(rules, model)
    assert sorted(exported) == sorted(source)
    np.testing.assert_array_equal(exported["v.bias"], source["v.bias"])
    cv.round_trip_check(rules, model)


def flawed_conversion() -> tuple[dict[str, np.ndarray], list[cv.Rule]]:
    """Source tensors and rules for `mlp` with seven coverage problems, one of each kind."""
    source = {
        "0.weight": np.zeros((8, 4), np.float32),
        "0.bias": np.zeros(8, np.int32),  # dtype kind
        "zero.weight": np.zeros((8, 4), np.float32),  # produced twice
        "2.bias": np.zeros(4, np.float32),  # shape
        "extra.scale": np.zeros(1, np.float32),  # no rule
        "3.weight": np.zeros((3, 8), np.float32),  # no such leaf
    }
    rules = [
        cv.Rule("zero.weight", "layers.0.kernel", cv.transpose()),
        cv.Rule("{i}.weight", "layers.{i}.kernel", cv.transpose()),
        cv.Rule("0.bias", "layers.0.bias"),
        cv.Rule("2.bias", "layers.2.bias"),
        cv.Rule("encoder.{i}.bias", "layers.{i}.bias"),
    ]
    return source, rules


def test_coverage_lists_every_problem_in_one_error_before_converting():
    source, rules = flawed_conversion()
    model = tt.eval_shape(mlp)
    with pytest.raises(cv.ConversionError, match=r"7 problems") as info:
        cv.convert(rules, source, target=model)
    message = str(info.value)
    for line in [
        r"'extra.scale': no rule consumes or ignores",
        r"'encoder.{i}.bias': Rule\('encoder.{i}.bias' -> .* matched no source",
        r"'layers.0.kernel': produced 2 times, from \[\['0.weight'\], \['zero",
        r"'layers.3.kernel': produced from \['3.weight'\].*did you mean",
        r"'layers.0.bias': dtype kind changes: the target holds float32\[8\], the "
        r"rule makes int32\[8\]",
        r"'layers.2.bias': shape mismatch: the target holds float32\[3\], the rule "
        r"makes float32\[4\] from \['2.bias'\]",
        r"'layers.2.kernel': no rule produces this target leaf",
    ]:
        assert re.search(line, message), line
    kinds = sorted(p.kind for p in info.value.problems)
    assert kinds == ["dtype", "duplicate", "missing", "shape", "unknown", "unmatched", "unused"]


def test_allow_by_pattern_gives_a_typed_report():
    source = {k: v for k, v in torch_state(torch_mlp()).items() if not k.startswith("2.")}
    source["0.num_batches_tracked"] = np.zeros((), np.int64)
    with pytest.raises(
        cv.ConversionError, match=r"  - 'layers.2.kernel': no rule produces"
    ) as info:
        cv.convert(MLP_RULES, source, target=mlp(), allow={"missing": ["layers.2.bias"]})
    assert [p.name for p in info.value.problems] == ["0.num_batches_tracked", "layers.2.kernel"]
    allow = {"missing": ["layers.2.*"], "unused": ["**.num_batches_tracked"]}
    report = cv.check(MLP_RULES, source, target=mlp(), allow=allow)
    assert [(p.kind, p.name) for p in report.allowed] == [
        ("unused", "0.num_batches_tracked"),
        ("missing", "layers.2.kernel"),
        ("missing", "layers.2.bias"),
    ]
    assert [s.targets for s in report.steps] == [("layers.0.kernel",), ("layers.0.bias",)]
    flat = cv.convert(MLP_RULES, source, target=mlp(), allow=allow)
    assert sorted(flat) == ["layers.0.bias", "layers.0.kernel"]
    with pytest.raises(ValueError, match=r"allow takes .* got 'shape'"):
        cv.check(MLP_RULES, source, target=mlp(), allow={"shape": ["**"]})


def test_an_allowance_matches_names_exactly_and_patterns_by_glob():
    allows = cv.Allowance({"missing": ["a.b", "a+b", "layers.*.kernel", "x.**"], "unused": []})
    assert allows("missing", "a.b") and allows("missing", "a+b")
    assert not any(allows("missing", n) for n in ["a.bc", "a", "aab", "a.b.c", "layers.3.bias"])
    assert allows("missing", "layers.3.kernel") and not allows("missing", "layers.3.4.kernel")
    assert allows("missing", "x") and allows("missing", "x.y.z")
    assert not allows("unused", "a.b") and not allows("unknown", "a.b")  # (another kind)
    with pytest.raises(ValueError, match=r"the pattern 'a\.\.b' has an empty part"):
        cv.Allowance({"missing": ["a..b"]})("missing", "c")


def test_a_plan_checks_its_problems_against_allow_in_time_linear_in_them(monkeypatch):
    """A quantized load lets each parameter's name and parts be missing, three names a
    parameter, and its plan checks every part against them: matched one name against one
    pattern at a time, 600 layers took a second of planning. Names are looked up, and only
    wildcards compiled."""
    import taktiny.convert._coverage as coverage

    names = [f"layers.{i}.kernel.{part}" for i in range(64) for part in ("value", "scale")]
    target = {n: jax.ShapeDtypeStruct((2,), jnp.float32) for n in names}
    compiled, real = [], coverage.compile_pattern
    monkeypatch.setattr(coverage, "compile_pattern", lambda p: compiled.append(p) or real(p))
    report = cv.check([], {}, target=target, allow={"missing": [*names, "extra.*"]})
    assert sorted(p.name for p in report.allowed) == sorted(names)
    assert compiled == ["extra.*"]  # (once, not once for each name and pattern)


def test_the_first_rule_matching_a_name_wins_whether_it_names_it_or_matches_a_template():
    from taktiny.convert._rules import FirstMatch

    template, named = cv.Rule("a.{i}.w", "t.{i}"), cv.Rule("a.0.w", "u")
    assert FirstMatch([template, named])("a.0.w") == (0, 0, {"i": "0"})
    assert FirstMatch([named, template])("a.0.w") == (0, 0, {})
    assert FirstMatch([named, template])("a.1.w") == (1, 0, {"i": "1"})
    pair = cv.Rule(["b.w", "b.s"], "v", cv.concatenate(0))
    assert FirstMatch([cv.Ignore("x"), pair, cv.Rule("b.s", "z")])("b.s") == (1, 1, {})
    assert FirstMatch([named, named])("a.0.w") == (0, 0, {})
    # a regex's source is a regex, even without wildcards: its dots match any character
    regex = cv.Rule("a.0.w", "t", regex=True)
    assert FirstMatch([regex])("aX0Yw") == (0, 0, {})
    assert FirstMatch([cv.Tie("e.w", "h.w"), regex])("a.0.w") == (1, 0, {})
    assert FirstMatch([named, cv.Ignore("**")])("c") == (1, 0, {})
    assert FirstMatch([named])("a.0") is None


def test_rules_written_for_each_layer_are_found_by_name_not_tried_one_by_one():
    """Rules of one layer each (``cv.linear`` of every layer, as a hand-written FP8 or
    quantized checkpoint's rules are) matched every name against every rule before: names
    x rules, 0.08 s for 400 layers and seconds for thousands. A template after them is
    not tried for the names they take."""
    from taktiny.convert._rules import FirstMatch

    class Counted:
        def __init__(self, pattern):
            self.pattern, self.calls = pattern, 0

        def fullmatch(self, name):
            self.calls += 1
            return self.pattern.fullmatch(name)

    rules = [r for i in range(200) for r in cv.linear(f"m.{i}.proj", f"layers.{i}")]
    rules.append(cv.Ignore("**.rotary.inv_freq"))
    for rule in rules:
        rule.patterns = [Counted(p) for p in rule.patterns]
    first = FirstMatch(rules)
    names = [f"m.{i}.proj.{part}" for i in range(200) for part in ("weight", "bias")]
    assert [first(n)[:2] for n in names] == [(k, 0) for k in range(400)]
    assert first("m.3.rotary.inv_freq") == (400, 0, {})
    assert [r.patterns[0].calls for r in rules] == [0] * 400 + [1]


def test_round_trip_check_fails_clearly_for_what_does_not_invert():
    model = mlp()
    cv.round_trip_check(MLP_RULES, model)
    one_way = [MLP_RULES[0], cv.Rule("{i}.bias", "layers.{i}.bias", cv.cast(jnp.float32))]
    with pytest.raises(cv.ConversionError, match=r"'layers.0.bias': .*cast"):
        cv.round_trip_check(one_way, model)

    class negate(cv.Transform):
        def __call__(self, arrays: tuple[Any, ...], count: int | None = None) -> tuple[Any, ...]:
            return tuple(-a for a in arrays)

        @property
        def inverse(self) -> cv.Transform:
            return cv.identity()  # wrong on purpose

    wrong = [MLP_RULES[0], cv.Rule("{i}.bias", "layers.{i}.bias", negate())]
    model = model.load_flat_state_dict({"layers.2.bias": jnp.ones(3)})
    with pytest.raises(
        cv.ConversionError, match=r"  - 'layers.2.bias': export then convert"
    ) as info:
        cv.round_trip_check(wrong, model)
    # bitwise: the zero biases of layer 0 come back as -0.0
    assert [p.name for p in info.value.problems] == ["layers.0.bias", "layers.2.bias"]

    class reinterpret(cv.Transform):  # the same bits read as another float: only the dtype
        def __call__(self, arrays: tuple[Any, ...], count: int | None = None) -> tuple[Any, ...]:
            return tuple(jax.lax.bitcast_convert_type(a, jnp.bfloat16) for a in arrays)

        @property
        def inverse(self) -> cv.Transform:
            return cv.identity()  # wrong on purpose

    halves = {"w": jnp.arange(3, dtype=jnp.float16)}
    with pytest.raises(cv.ConversionError, match=r"^convert\.round_trip_check: 1 problem; "
                       r"nothing was converted\.\n  - 'w': export then convert "
                       r"gives bfloat16\[3\] with other values than the model's float16\[3\]"):  # fmt: skip
        cv.round_trip_check([cv.Rule("w", "w", reinterpret())], halves)


def test_tied_source_names_map_to_one_parameter_both_ways():
    rules = [cv.Rule("embed.weight", "embedding"), cv.Tie("lm_head.weight", same_as="embed.weight")]
    model = nn.Embed(5, 3, rngs=nn.Rngs(0))
    table = np.random.default_rng(3).standard_normal((5, 3), dtype=np.float32)
    flat = cv.convert(rules, {"embed.weight": table, "lm_head.weight": table.copy()}, target=model)
    np.testing.assert_array_equal(flat["embedding"], table)
    model = model.load_flat_state_dict(flat)
    # save_pretrained leaves the tied copy out: so does export, unless the Tie says otherwise
    assert sorted(cv.export(rules, model)) == ["embed.weight"]
    written = [rules[0], cv.Tie("lm_head.weight", same_as="embed.weight", export=True)]
    assert repr(written[1]) == "Tie('lm_head.weight', same_as='embed.weight', export=True)"
    exported = cv.export(written, model)
    assert sorted(exported) == ["embed.weight", "lm_head.weight"]
    np.testing.assert_array_equal(exported["lm_head.weight"], table)
    cv.round_trip_check(rules, model)
    cv.round_trip_check(written, model)
    # a source without the tied copy converts, with nothing allowed
    alone = cv.convert(rules, {"embed.weight": table}, target=model)
    np.testing.assert_array_equal(alone["embedding"], table)
    assert cv.check(rules, {"embed.weight": table}, target=model).allowed == ()
    untied = {"embed.weight": table, "lm_head.weight": table + 1}
    with pytest.raises(cv.ConversionError, match=r"^convert\.convert: 1 problem; nothing was "
                       r"converted\.\n  - 'lm_head.weight': is tied to 'embed"):  # fmt: skip
        cv.convert(rules, untied, target=model)
    with pytest.raises(cv.ConversionError, match=r"'lm_head.weight': is tied to 'embed.w"
                       r"eight', which the source lacks, so it holds the array under this name "
                       r"alone: replace the Tie by a Rule that reads 'lm_head.weight' where "
                       r"'embed.weight' would go\.$"):  # fmt: skip
        cv.convert(rules, {"lm_head.weight": table}, target=model, allow={"missing": ["**"]})


def test_an_ignore_reports_what_it_drops_and_may_export_a_value_beside_its_prefix():
    source = {"a.0.w": np.ones(2, np.float32), "a.0.n": np.int64(5), "a.1.w": np.zeros(2, np.float32),
              "a.1.n": np.int64(6), "ids": np.arange(3)}  # fmt: skip
    rules = [cv.Rule("a.{i}.w", "b.{i}"), cv.Ignore("a.{i}.n", export=np.int64(0)),
             cv.Ignore("**.ids", "**.absent")]  # fmt: skip
    target = {"b.0": jnp.ones(2), "b.1": jnp.ones(2)}  # (a flat state)
    report = cv.check(rules, source, target=target)
    assert report.ignored == ("a.0.n", "a.1.n", "ids")  # in the source's order
    assert report.allowed == ()  # (a pattern that matches nothing is no problem)
    exported = cv.export(rules, target)
    assert sorted(exported) == ["a.0.n", "a.0.w", "a.1.n", "a.1.w"]  # no ids: nothing to write
    assert exported["a.1.n"] == 0 and exported["a.1.n"].dtype == np.int64
    cv.round_trip_check(rules, target)


def test_rule_errors_name_the_rule():
    with pytest.raises(ValueError, match=r"Rule\('layers\\\\.\(\?P<i>.*not a valid regular exp"):
        cv.Rule(r"layers\.(?P<i>\d+", "layers.{i}.kernel", regex=True)
    with pytest.raises(ValueError, match=r"Rule\('a.{i}' -> 'b.{j}'.*uses \['j'\], which the"):
        cv.Rule("a.{i}", "b.{j}")
    with pytest.raises(ValueError, match=r"the target 'b.\*' has a wildcard"):
        cv.Rule("a.*", "b.*")


def test_a_rule_that_matches_nothing_is_told_what_to_check():
    source = {"encoder.0.bias": np.zeros(3, np.float32), "w": np.zeros(3, np.float32)}
    rules = [
        cv.Rule("w", "b"),
        cv.Rule("encodr.{i}.bias", "x.{i}"),  # its captures read as '*'
        cv.Rule(r"enc\.(?P<i>\d+)\.bias", "y.{i}", regex=True),
        cv.Rule("a.*{i}*", "z.{i}"),  # 'a.***' is no pattern
        cv.Rule(["q.{x}", "k.{x}"], "{x}", cv.concatenate()),  # named by all its sources
        cv.Ignore("encoder.**"),
        cv.Tie("lm_head", same_as="w"),  # matching nothing: a tied copy left out, no problem
    ]
    target = {"b": jax.ShapeDtypeStruct((3,), jnp.float32)}
    with pytest.raises(cv.ConversionError) as info:
        cv.check(rules, source, target=target)
    assert str(info.value).splitlines()[0] == "convert.check: 4 problems; nothing was converted."
    assert [str(p) for p in info.value.problems] == [
        "'encodr.{i}.bias': Rule('encodr.{i}.bias' -> 'x.{i}', identity()) matched "
        "no source name; did you mean 'encoder.*.bias'?",
        r"'enc\\.(?P<i>\\d+)\\.bias': Rule('enc\\.(?P<i>\\d+)\\.bias' -> 'y.{i}', "
        "identity()) matched no source name; check the regular expression against the names.",
        "'a.*{i}*': Rule('a.*{i}*' -> 'z.{i}', identity()) matched no source name; "
        "check the pattern against the names.",
        "'q.{x}, k.{x}': Rule(['q.{x}', 'k.{x}'] -> '{x}', concatenate(axis=0)) "
        "matched no source name; no name is close to it.",
    ]


RULE_ERRORS = [  # (make the rule, its whole message)
    (lambda: cv.Rule("", "b"),
     "Rule('' -> 'b', identity()): a name template is a non-empty string, got ''."),
    (lambda: cv.Rule("a..b", "b"),
     "Rule('a..b' -> 'b', identity()): the template 'a..b' has an empty part."),
    (lambda: cv.Rule("a.[x", "b"),
     "Rule('a.[x' -> 'b', identity()): the pattern 'a.[x' has a '[' without its ']'."),
    (lambda: cv.Rule([], "b"),
     "Rule('?' -> 'b', identity()): a rule needs at least one source and one target."),
    (lambda: cv.Rule("a", []),
     "Rule('a' -> [], identity()): a rule needs at least one source and one target."),
    (lambda: cv.Rule("a(", "b", regex=True),
     "Rule('a(' -> 'b', identity()): the source is not a valid regular expression: missing ), "
     "unterminated subpattern at position 2. Escape the dots in names (r'layers\\.0'), or pass "
     "a template without regex=True."),
    (lambda: cv.Rule("a.*", ["b", "c?"]),
     "Rule('a.*' -> ['b', 'c?'], identity()): the target 'c?' has a wildcard; a target names "
     "one parameter, with {name} captures from the source only (and a '**' part for the "
     "parts the source's '**' matched)."),
    (lambda: cv.Rule("a.**.b.**", "c.**"),
     "Rule('a.**.b.**' -> 'c.**', identity()): a target's '**' stands for the parts the "
     "source's '**' matched, so every source and every target needs exactly one '**' part, "
     "and 'a.**.b.**' has 2; with two, which parts each stands for would be ambiguous: "
     "capture single parts with {name} instead."),
    (lambda: cv.Rule("a.w", "**.k"),
     "Rule('a.w' -> '**.k', identity()): a target's '**' stands for the parts the source's "
     "'**' matched, so every source and every target needs exactly one '**' part, and 'a.w' "
     "has 0."),
    (lambda: cv.Rule(["a.**.q", "a.**.k"], ["**.qk", "v"], cv.concatenate()),
     "Rule(['a.**.q', 'a.**.k'] -> ['**.qk', 'v'], concatenate(axis=0)): a target's '**' "
     "stands for the parts the source's '**' matched, so every source and every target needs "
     "exactly one '**' part, and 'v' has 0."),
    (lambda: cv.Rule("a.**", "b.x**"),
     "Rule('a.**' -> 'b.x**', identity()): the target 'b.x**' has a wildcard; a target names "
     "one parameter, with {name} captures from the source only (and a '**' part for the "
     "parts the source's '**' matched)."),
    (lambda: cv.Rule("a.**", "b.**."),
     "Rule('a.**' -> 'b.**.', identity()): the template 'b.**.' has an empty part."),
    (lambda: cv.Rule(r"a\.(?P<rest>.+)", "b.**", regex=True),
     "Rule('a\\\\.(?P<rest>.+)' -> 'b.**', identity()): a target's '**' stands for the parts "
     "a template's '**' matched; with regex=True, capture the parts in a named group "
     "((?P<rest>.+)) and write {rest} in the target."),
    (lambda: cv.Rule(["a.{i}", "c"], "b.{i}"),
     "Rule(['a.{i}', 'c'] -> 'b.{i}', identity()): the target uses ['i'], which the source "
     "'c' does not capture."),
    (lambda: cv.Rule(r"a\.(?P<i>\d+)", "b.{j}.{i}.{k}", regex=True),
     "Rule('a\\\\.(?P<i>\\\\d+)' -> 'b.{j}.{i}.{k}', identity()): the target uses ['j', 'k'], "
     "which the source 'a\\\\.(?P<i>\\\\d+)' does not capture."),
    (lambda: cv.Rule("a.{j}.{i}", "b"),
     "Rule('a.{j}.{i}' -> 'b', identity()): the captures ['i', 'j'] are not in the target; a "
     "rule gathers over at most one capture, from a single source template."),
    (lambda: cv.Rule(["a.{i}", "c.{i}"], "b"),
     "Rule(['a.{i}', 'c.{i}'] -> 'b', identity()): the captures ['i'] are not in the target; "
     "a rule gathers over at most one capture, from a single source template."),
    (lambda: cv.Ignore(), "Ignore() needs at least one name pattern."),
    (lambda: cv.Ignore("a.{i}.n", "**.n", export=0),
     "Ignore('a.{i}.n', '**.n', export=array(0)): with export=, each pattern must be a "
     "template without wildcards, so that export can name what it writes."),
    (lambda: cv.Tie("a.*", same_as="b"),
     "Tie('a.*', same_as='b'): both names must be templates with the same captures and no "
     "wildcards, so each tied name has exactly one partner."),
    (lambda: cv.Tie("a", same_as="b.[c]"),
     "Tie('a', same_as='b.[c]'): both names must be templates with the same captures and no "
     "wildcards, so each tied name has exactly one partner."),
    (lambda: cv.Tie("a.{i}", same_as="b.{j}"),
     "Tie('a.{i}', same_as='b.{j}'): both names must be templates with the same captures and "
     "no wildcards, so each tied name has exactly one partner."),
    (lambda: cv.Tie("a", same_as="b..c"), "Tie('a', same_as='b..c'): the template 'b..c' has "
     "an empty part."),
    (lambda: cv.Tie("a.[b", same_as="c"), "Tie('a.[b', same_as='c'): the pattern 'a.[b' has a "
     "'[' without its ']'."),
]  # fmt: skip


@pytest.mark.parametrize("make, message", RULE_ERRORS)
def test_rule_errors_are_whole_sentences_that_name_the_rule(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value) == message


def test_an_ignore_names_its_patterns_in_its_errors():
    with pytest.raises(ValueError, match=r"^Ignore\('x', 'a..b'\): the template 'a..b' has an "):
        cv.Ignore("x", "a..b")
    assert repr(cv.Ignore("a", "b.*")) == "Ignore('a', 'b.*')"


def test_a_regex_rule_may_anchor_its_expression():
    anchored = cv.Rule(r"^layers\.(?P<i>\d+)\.weight$", "k.{i}", regex=True)
    assert anchored.patterns[0].fullmatch(".layers.3.weight").groupdict() == {"i": "3"}
    assert not anchored.patterns[0].fullmatch(".layers.3.weight.x")


def test_a_regex_rule_matches_an_escaped_dollar_as_a_character():
    dollar = cv.Rule(r"cost\$", "cost", regex=True)  # an escaped '$' is a character
    assert dollar.patterns[0].fullmatch(".cost$") and not dollar.patterns[0].fullmatch(".cost")


def test_rules_know_their_captures_and_whether_they_export():
    rule = cv.Rule(["a.{j}.{i}", "c.{i}.{j}"], "b.{i}.{j}")
    assert (rule.kept, rule.gathered) == (("i", "j"), None)
    assert rule.target_names({"i": "1", "j": "x"}) == ("b.1.x",)
    assert (cv.Rule("a.{i}", "b").kept, cv.Rule("a.{i}", "b").gathered) == ((), "i")
    matches = lambda rule, name: rule.patterns[0].fullmatch("." + name)
    deep = cv.Rule("enc.**.bias", "bias")
    assert matches(deep, "enc.bias") and matches(deep, "enc.a.b.bias")
    assert not matches(deep, "enc.a.weight")
    within = cv.Rule("h.layer_{i}x.w", "l.{i}")  # a capture inside a part
    assert within.patterns[0].fullmatch(".h.layer_3x.w").groupdict() == {"i": "3"}
    assert not matches(within, "h.layer_3.w")
    assert cv.Rule("X.Y", "Z.X").targets == ("Z.X",)  # capital letters are no wildcards
    twice = cv.Rule("a.{i}.b.{i}", "c.{i}")  # a capture used twice must capture alike
    assert twice.patterns[0].fullmatch(".a.1.b.1") and not twice.patterns[0].fullmatch(".a.1.b.2")
    assert cv.Rule("x", "y").irreversible() is None
    assert cv.Rule(r"x\.(?P<i>\d+)", "y.{i}", regex=True).irreversible() == (
        "its source is a regular expression, not a template that names one source"
    )
    assert cv.Rule("x.*", "y").irreversible() == (
        "its source has a wildcard, so it does not name one source"
    )
    assert cv.Rule("x", "y", cv.cast("float32")).irreversible() == (
        "its transform cast('float32') has no inverse"
    )
    assert repr(cv.Tie("a", same_as="b")) == "Tie('a', same_as='b')"  # fmt: skip


def test_a_double_star_in_the_target_carries_the_parts_its_source_matched():
    """A '**' in source and target renames a prefix at every depth, none included, and
    exports back; it is a capture the targets keep (one step per path), and it gathers."""
    rule = cv.Rule("model.**.weight", "**.kernel", cv.transpose())
    assert rule.deep and rule.kept == ("__deep__",) and rule.gathered is None
    assert rule.irreversible() is None
    assert rule.target_names({"__deep__": "a.b"}) == ("a.b.kernel",)
    assert rule.target_names({"__deep__": ""}) == ("kernel",)  # no part: the dot goes too
    source = {
        "model.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
        "model.a.weight": np.arange(4, dtype=np.float32).reshape(1, 4),
        "model.a.b.c.weight": np.arange(10, dtype=np.float32).reshape(5, 2),
    }
    target = {"kernel": np.zeros((3, 2), np.float32), "a.kernel": np.zeros((4, 1), np.float32),
              "a.b.c.kernel": np.zeros((2, 5), np.float32)}  # fmt: skip
    flat = cv.convert([rule], source, target=target)
    assert list(flat) == ["kernel", "a.kernel", "a.b.c.kernel"]
    np.testing.assert_array_equal(flat["a.b.c.kernel"], source["model.a.b.c.weight"].T)
    back = cv.export([rule], flat)
    assert sorted(back) == sorted(source)
    assert all(np.array_equal(back[n], source[n]) for n in source)
    cv.round_trip_check([rule], flat)
    prefix = cv.Rule("blocks.**", "layers.**")  # a prefix renamed, at the end of the names
    named = {"blocks.0.attn.kernel": np.zeros(1), "blocks.1.norm.scale": np.zeros(1)}
    made = cv.convert([prefix], named, target={"layers.0.attn.kernel": np.zeros(1),
                                               "layers.1.norm.scale": np.zeros(1)})  # fmt: skip
    assert sorted(made) == ["layers.0.attn.kernel", "layers.1.norm.scale"]
    stacked = cv.Rule("h.{i}.**.w", "stack.**.w", cv.stack(0))  # gathers {i} per path
    layers = {f"h.{i}.{path}.w": np.full(2, 10 * i + k, np.float32)
              for i in range(3) for k, path in enumerate(("mlp", "attn.q"))}  # fmt: skip
    made = cv.convert([stacked], layers, target={"stack.mlp.w": np.zeros((3, 2), np.float32),
                                                 "stack.attn.q.w": np.zeros((3, 2), np.float32)})  # fmt: skip
    np.testing.assert_array_equal(made["stack.attn.q.w"][:, 0], [1, 11, 21])
    assert sorted(cv.export([stacked], made)) == sorted(layers)
    matches = lambda rule, name: rule.patterns[0].fullmatch("." + name) is not None
    assert matches(rule, "model.weight") and not matches(rule, "model.weight.x")
    assert not matches(rule, "modelweight") and not matches(rule, "model..weight")


def test_regex_rules_convert_but_do_not_export():
    rules = [
        cv.Rule(r"(?P<i>\d+)\.weight", "layers.{i}.kernel", cv.transpose(), regex=True),
        MLP_RULES[1],
    ]
    flat = cv.convert(rules, torch_state(torch_mlp()), target=mlp())
    assert flat["layers.2.kernel"].shape == (8, 3)
    with pytest.raises(cv.ConversionError, match=r"'layers.0.kernel': .*regular expression"):
        cv.export(rules, mlp())


def test_gathered_indices_must_be_0_to_n_minus_1():
    source = {f"layers.{i}.{n}": np.zeros((3, 3) if n == "weight" else 3, np.float32)
              for i in (0, 2) for n in ("weight", "bias")}  # fmt: skip
    with pytest.raises(
        cv.ConversionError, match=r"  - 'layers.0.weight': Rule.* gathers {i} over \['0', '2'\]"
    ):
        cv.convert(STACK_RULES, source, target=Stacked(2, 3))


class Lazy(Mapping[str, Any]):
    def __init__(self, values: dict[str, Any]):
        self.values, self.read = values, []

    def __getitem__(self, name: str) -> Any:
        self.read.append(name)
        return self.values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)


def test_only_what_the_rules_need_is_read():
    source = Lazy({**torch_state(torch_mlp()), "0.num_batches_tracked": np.zeros((), np.int64)})
    rules = [*MLP_RULES, cv.Ignore("*.num_batches_tracked")]
    cv.convert(rules, source, target=mlp())
    assert "0.num_batches_tracked" not in source.read
    assert sorted(set(source.read)) == ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_permutes_a_torch_conv_kernel_and_back():
    theirs = randomize_(torch.nn.Conv2d(2, 5, (3, 4), padding="valid"))
    rules = [
        cv.Rule(
            "weight", "kernel", cv.transpose((2, 3, 1, 0))
        ),  # [out, in, h, w] -> [h, w, in, out]
        cv.Rule("bias", "bias"),
    ]
    model = nn.Conv(2, 5, (3, 4), padding="VALID", precision="highest", rngs=nn.Rngs(0))
    model = model.load_flat_state_dict(cv.convert(rules, theirs.state_dict(), target=model))
    x = np.random.default_rng(4).standard_normal((1, 2, 6, 7), dtype=np.float32)
    ours = model(jnp.asarray(np.moveaxis(x, 1, -1)))
    assert_close(ours, np.moveaxis(numpy(theirs(torch.from_numpy(x))), 1, -1))
    np.testing.assert_array_equal(cv.export(rules, model)["weight"], numpy(theirs.weight))
    cv.round_trip_check(rules, model)


def test_a_split_along_a_later_axis_joins_back_along_it():
    rules = [cv.Rule("gate_up", ["gate", "up"], cv.split(axis=1))]
    fused = np.arange(12, dtype=np.float32).reshape(2, 6)
    target = {n: jax.ShapeDtypeStruct((2, 3), jnp.float32) for n in ("gate", "up")}
    flat = cv.convert(rules, {"gate_up": fused}, target=target)
    np.testing.assert_array_equal(flat["up"], fused[:, 3:])
    np.testing.assert_array_equal(cv.export(rules, flat)["gate_up"], fused)


def test_a_capture_used_twice_must_capture_the_same_part():
    rules = [cv.Rule("blocks.{i}.sub.{i}.w", "layers.{i}.kernel"), cv.Ignore("**")]
    target = {"layers.1.kernel": jax.ShapeDtypeStruct((2,), jnp.float32)}
    source = {n: np.zeros(2, np.float32) for n in ("blocks.1.sub.1.w", "blocks.1.sub.2.w")}
    report = cv.check(rules, source, target=target)
    assert [s.sources for s in report.steps] == [("blocks.1.sub.1.w",)]


def test_incomplete_sources_wildcard_duplicates_and_failing_transforms_are_reported():
    rules = [
        cv.Rule(["q.{x}", "k.{x}"], "{x}", cv.concatenate(axis=-1)),
        cv.Rule("*.gate", "gate"),
        cv.Rule("fused", ["a", "b"], cv.split(axis=0)),
        cv.Rule("late", "c"),  # a step after the failing one is still checked
    ]
    source = {n: np.zeros(3, np.float32) for n in ("q.w", "up.gate", "down.gate", "fused")}
    source["late"] = np.zeros(4, np.float32)
    target = {n: jax.ShapeDtypeStruct((3,), jnp.float32) for n in ("w", "gate", "a", "b", "c")}
    with pytest.raises(cv.ConversionError, match=r"4 problems") as info:
        cv.check(rules, source, target=target, allow={"missing": ["**"]})
    messages = [str(p) for p in info.value.problems]
    assert messages[:2] == [
        "'q.w': Rule(['q.{x}', 'k.{x}'] -> '{x}', concatenate(axis=-1)) found "
        "['q.w'] but no name for ['k.{x}']; it needs all its sources to make ['w'].",
        "'gate': Rule('*.gate' -> 'gate', identity()) makes it from each of "
        "['up.gate', 'down.gate']; make the source pattern name one source.",
    ]
    assert messages[2].startswith(  # (then JAX's own words)
        "'fused': Rule('fused' -> ['a', 'b'], split(axis=0)) failed on ['fused']: "
        "array split does not result in an equal division"
    )
    assert messages[3] == (
        "'c': shape mismatch: the target holds float32[3], the rule makes float32[4] "
        "from ['late']; fix its transform."
    )


def test_convert_quantize_and_dequantize_invert_each_other():
    w = jax.random.normal(jax.random.key(0), (32, 8))
    q = tt.QArray.quantize(w, bits=4, group_size=8)
    rule = cv.Rule("w", ["q.value", "q.scale"], cv.quantize(bits=4, group_size=8))
    target = {"q.value": q.value, "q.scale": q.scale}
    converted = dict(cv.convert([rule], {"w": np.asarray(w)}, target=target))
    assert np.asarray(converted["q.value"]).tobytes() == np.asarray(q.value).tobytes()
    assert np.array_equal(converted["q.scale"], q.scale)
    exported = cv.export([rule], target)
    assert np.array_equal(exported["w"], q.dequantize())
    assert repr(rule.transform.inverse) == "dequantize(axis=0, group_size=8, bits=4)"
    assert repr(cv.dequantize(1, dtype=jnp.bfloat16)) == "dequantize(axis=1, dtype='bfloat16')"
    assert cv.dequantize().inverse is None
    assert cv.quantize(4, 0, 8) == rule.transform.inverse.inverse
    with pytest.raises(ValueError, match=r"dequantize\(axis=0\) takes two arrays, the values and the scales, got 1"):  # fmt: skip
        cv.dequantize()((w,))


def test_the_converted_mapping_makes_each_value_on_lookup_from_its_own_sources():
    rules = [cv.Rule("fused", ["a", "b"], cv.split(0)), cv.Rule("c", "c")]
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    source = Lazy({"fused": [1.0, 2.0, 3.0, 4.0], "c": np.zeros(3, np.float32)})  # a list too
    flat = cv.convert(rules, source, target={"c": f32(3), "b": f32(2), "a": f32(2)})
    assert repr(flat) == "Converted(3 names from 2 steps)" and len(flat) == 3
    assert list(flat) == ["c", "b", "a"]  # the target's order
    source.read.clear()  # (the check read the shapes)
    assert "a" in flat and "fused" not in flat and source.read == []  # nothing read to know
    assert [s.targets for s in flat.steps] == [("a", "b"), ("c",)]
    np.testing.assert_array_equal(flat["b"], [3.0, 4.0])
    assert source.read == ["fused"]
    np.testing.assert_array_equal(flat["a"], [1.0, 2.0])  # kept from the split: not read
    assert source.read == ["fused"]
    np.testing.assert_array_equal(flat["a"], [1.0, 2.0])  # looked up again: made again
    assert source.read == ["fused", "fused"]
    np.testing.assert_array_equal(flat["c"], np.zeros(3))
    np.testing.assert_array_equal(flat["c"], np.zeros(3))  # nothing kept of a lone target
    assert source.read == ["fused", "fused", "c", "c"]
    abstract = cv.convert(rules, {"fused": f32(4), "c": f32(3)}, target={"a": f32(2), "b": f32(2), "c": f32(3)})  # fmt: skip
    assert abstract["b"] == f32(2) and abstract["c"] == f32(3)


def test_export_and_round_trip_errors_name_every_leaf_and_why():
    rules = [
        cv.Rule("fused", ["a", "b"], cv.split(0)),
        cv.Rule("c", "c", cv.cast("float32")),
        cv.Rule("{i}.w", "layers.{i}.w", cv.transpose()),
    ]
    # (a leaf no rule makes, first: the leaves after it are looked at still)
    model = {"d": np.zeros(1), "a": np.zeros(2, np.float32), "c": np.zeros(2, np.float32),
             "layers.0.w": np.ones((2, 3), np.float32)}  # fmt: skip
    with pytest.raises(cv.ConversionError) as info:
        cv.export(rules, model)
    assert str(info.value) == (
        "convert.export: 3 problems; nothing was converted.\n"
        "  - 'd': no rule produces this leaf, so export cannot name it; add a Rule.\n"
        "  - 'a': Rule('fused' -> ['a', 'b'], split(axis=0)) cannot export it: "
        "the model lacks ['b'].\n"
        "  - 'c': Rule('c' -> 'c', cast('float32')) cannot export it: its "
        "transform cast('float32') has no inverse."
    )
    with pytest.raises(ValueError) as info:  # a target no name can have, met on export
        cv.export([cv.Rule("x", "a..b")], {"a..b": np.zeros(2)})
    assert str(info.value) == "Rule('x' -> 'a..b', identity()): the template 'a..b' has an empty part."  # fmt: skip
    halves = [cv.Rule("x", "x", cv.cast("float16", source_dtype="float32"))]
    with pytest.raises(cv.ConversionError) as info:
        cv.round_trip_check(halves, {"x": np.ones(2, np.float32)})
    assert str(info.value) == (
        "convert.round_trip_check: 1 problem; nothing was converted.\n"
        "  - 'x': export then convert gives float16[2] with other values than the "
        "model's float32[2]; a transform and its inverse disagree."
    )
    tied = [cv.Rule("e", "e"), cv.Tie("h", same_as="e")]
    target = {"e": jax.ShapeDtypeStruct((2,), jnp.float32)}
    with pytest.raises(cv.ConversionError) as info:
        cv.convert(tied, {"e": np.ones(2, np.float32), "h": np.ones(3, np.float32)}, target=target)
    assert str(info.value) == (
        "convert.convert: 1 problem; nothing was converted.\n"
        "  - 'h': is tied to 'e' but holds float32[3], not float32[2]."
    )
    with pytest.raises(cv.ConversionError) as info:
        cv.convert(tied, {"e": np.ones(2, np.float32), "h": np.zeros(2, np.float32)}, target=target)
    assert str(info.value).splitlines()[1] == "  - 'h': is tied to 'e', but their values differ."


class Q(nn.Module):
    def __init__(self, *, rngs):
        self.q = nn.Linear(8, 4, rngs=rngs)


class StackAndHead(nn.Module):
    def __init__(self, *, rngs):
        self.stack = nn.Stack(lambda r: Q(rngs=r), 2, rngs=rngs)
        self.head = nn.Linear(4, 2, rngs=rngs)


def test_export_of_a_quantized_weight_says_to_dequantize_first():
    """A quantized model exported with float rules: one problem per quantized weight (not
    one per part, nor "add a Rule"), naming the two fixes; dequantized, it exports, the
    same with a stack's per-layer rules. Seen to fail with the parts reported as leaves
    no rule produces."""
    model = StackAndHead(rngs=nn.Rngs(0))
    rules = [cv.Rule("l.{i}.q.weight", "stack.{i}.q.kernel", cv.transpose()),
             cv.Rule("l.{i}.q.bias", "stack.{i}.q.bias"), cv.Rule("h.weight", "head.kernel", cv.transpose()),
             cv.Rule("h.bias", "head.bias")]  # fmt: skip
    quantized = tt.quantize(model, where="stack.**", bits=4, group_size=4)
    with pytest.raises(cv.ConversionError) as info:
        cv.export(rules, quantized)
    fix = ("a quantized weight, which these rules export as a float array; dequantize the "
           "model first (taktiny.dequantize), or write it quantized with "
           "convert.export_compressed_tensors.")  # fmt: skip
    assert str(info.value).splitlines() == [
        "convert.export: 2 problems; nothing was converted.",
        f"  - 'stack.0.q.kernel': {fix}",
        f"  - 'stack.1.q.kernel': {fix}",
    ]
    problem = info.value.problems[0]
    assert (problem.kind, problem.expected, problem.got) == (
        "representation",
        "a float array",
        "a QArray",
    )
    exported = cv.export(rules, tt.dequantize(quantized))
    np.testing.assert_array_equal(
        exported["l.1.q.weight"], np.asarray(quantized.stack[1].q.kernel.dequantize()).T
    )
    # a flat state of another layout keeps "add a Rule"
    with pytest.raises(cv.ConversionError, match=r"'x\.value': no rule produces this leaf"):
        cv.export(rules, {"x.value": np.zeros(2)})


def test_coverage_problems_read_in_full():
    source, rules = flawed_conversion()
    with pytest.raises(cv.ConversionError) as info:
        cv.convert(rules, source, target=tt.eval_shape(mlp))
    missing = ("no rule produces this target leaf; add a Rule, or allow it (allow={'missing': "
               "[...]}) and load with strict=False.")  # fmt: skip
    assert str(info.value).splitlines() == [
        "convert.convert: 7 problems; nothing was converted.",
        "  - 'extra.scale': no rule consumes or ignores this source name; add a Rule "
        "for it, or an Ignore.",
        "  - 'encoder.{i}.bias': Rule('encoder.{i}.bias' -> 'layers.{i}.bias', "
        "identity()) matched no source name; no name is close to it.",
        "  - 'layers.0.kernel': produced 2 times, from [['0.weight'], "
        "['zero.weight']]; make the patterns disjoint.",
        "  - 'layers.0.bias': dtype kind changes: the target holds float32[8], the rule "
        "makes int32[8]; add a cast, or fix the rule.",
        "  - 'layers.2.bias': shape mismatch: the target holds float32[3], the rule makes "
        "float32[4] from ['2.bias']; fix its transform.",
        "  - 'layers.3.kernel': produced from ['3.weight'], but the target has no such "
        "leaf; did you mean 'layers.2.kernel'?",
        f"  - 'layers.2.kernel': {missing}",
    ]
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    with pytest.raises(cv.ConversionError) as info:  # one problem, the others allowed
        cv.check([cv.Rule("a", "zzzzzz_qqq")], {"a": np.zeros(2, np.float32)},
                 target={"b": f32(2)}, allow={"missing": ["b"]})  # fmt: skip
    assert str(info.value).splitlines() == [
        "convert.check: 1 problem; nothing was converted.",
        "  - 'zzzzzz_qqq': produced from ['a'], but the target has no such leaf; fix "
        "the rule's target template.",
    ]
    targets = {n: f32(1) for n in "abc"}
    with pytest.raises(cv.ConversionError) as info:
        cv.check([cv.Rule("f", ["a", "b", "c"], cv.split(0, [1, 1]))], {"f": np.zeros(2)},
                 target=targets, allow={"missing": ["*"]})  # fmt: skip
    assert str(info.value).splitlines()[1] == (
        "  - 'f': Rule('f' -> ['a', 'b', 'c'], split(axis=0, sizes=(1, 1))) failed "
        "on ['f']: it made 2 arrays for 3 targets"
    )
    with pytest.raises(cv.ConversionError) as info:
        cv.check([cv.Rule("layers.{i}.w", "w", cv.stack())], {"layers.1.w": np.zeros(2)},
                 target={"w": f32(1, 2)}, allow={"missing": ["w"]})  # fmt: skip
    assert str(info.value).splitlines()[1] == (
        "  - 'layers.1.w': Rule('layers.{i}.w' -> 'w', stack(axis=0)) gathers {i} over "
        "['1'], which must be 0, 1, ..., n-1."
    )
    for allow in [{"missing": "b"}, {"shape": ["b"]}]:
        kind, patterns = next(iter(allow.items()))
        with pytest.raises(ValueError) as info:
            cv.check([], {}, target={}, allow=allow)
        assert str(info.value) == (
            "allow takes {kind: [patterns]} with kinds ['unused', 'missing', 'unknown', "
            f"'unmatched'], got {kind!r}: {patterns!r}. Shapes, dtypes and duplicates are never "
            "allowed: fix the rule."
        )
    report = cv.check(
        [cv.Rule("a", "b"), cv.Rule("x.{i}", "y.{i}")],
        {"a": np.zeros(2, np.float32), "q": np.zeros(1)},
        target={"b": f32(2), "m.n": f32(1)},
        allow={"unused": ["q"], "missing": ["m.*"], "unmatched": ["x.{i}"]},  # a rule by name
    )
    assert [(p.kind, p.name) for p in report.allowed] == [
        ("unused", "q"), ("unmatched", "x.{i}"), ("missing", "m.n")]  # fmt: skip
    assert [(s.sources, s.targets) for s in report.steps] == [(("a",), ("b",))]


def test_coverage_reads_shapes_and_dtypes_without_the_data_where_it_can():
    from taktiny.convert._coverage import spec

    class Handle:  # a lazy tensor: shape and dtype, and data it must not read
        shape, dtype = [4, 2], "float16"

        def __array__(self, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError("read")

    class Shaped:  # a shape but no dtype: its data tells the dtype
        shape = (3,)

        def __array__(self, *args: Any, **kwargs: Any) -> Any:
            return np.array([1, 2, 3], np.int8)

    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    assert spec(Handle()) == jax.ShapeDtypeStruct((4, 2), jnp.float16)
    assert spec(np.zeros((2, 3), np.float64)) == f32(2, 3)  # as JAX would hold it
    assert spec(jax.ShapeDtypeStruct((2,), jnp.float64)) == f32(2)
    assert spec(jax.ShapeDtypeStruct((2,), jnp.int8)) == jax.ShapeDtypeStruct((2,), jnp.int8)
    assert spec([1, 2]) == jax.ShapeDtypeStruct((2,), jnp.int32)  # read: no shape
    assert spec(Shaped()) == jax.ShapeDtypeStruct((3,), jnp.int8)  # read: a shape, no dtype
    assert spec(torch.zeros(2, 3)) == f32(2, 3)  # read: a torch dtype is not NumPy's


class Cut(cv.Transform):
    """A transform of the user's whose repr does not show what it does: the first `n`
    rows (every instance reads ``Cut()``)."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, arrays, count=None):
        return tuple(a[: self.n] for a in arrays)


def test_a_plan_traces_equal_transforms_once_a_shape_and_never_trusts_a_users_repr(
    monkeypatch,
):
    """A per-layer rule's steps share one trace of their transform for each input shape
    (each trace costs about a millisecond a step; a 32-layer FP8 load planned 32); a
    transform of the user's class is traced for every step, its repr being no promise of
    what it makes."""
    from taktiny.convert import _coverage

    traced = []
    real = _coverage.runner
    monkeypatch.setattr(_coverage, "runner", lambda t, count: traced.append(t) or real(t, count))
    source = {f"l.{i}.w": np.zeros((3, 5 if i == 3 else 4), np.float32) for i in range(4)}
    target = {f"l.{i}.w": np.zeros((5 if i == 3 else 4, 3), np.float32) for i in range(4)}
    flat = cv.convert([cv.Rule("l.{i}.w", "l.{i}.w", cv.transpose())], source, target=target)
    assert [np.shape(flat[n]) for n in target] == [(4, 3), (4, 3), (4, 3), (5, 3)]
    assert len(traced) == 2  # (layers 0-2 alike; layer 3's inputs another shape)
    traced.clear()
    rules = [cv.Rule(f"l.{i}.w", f"l.{i}.w", Cut(i + 1)) for i in range(4)]
    cut = {f"l.{i}.w": np.zeros((i + 1, 4), np.float32) for i in range(4)}
    flat = cv.convert(
        rules, {n: np.zeros((3 if n != "l.3.w" else 4, 4), np.float32) for n in cut}, target=cut
    )
    assert [np.shape(flat[n]) for n in cut] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert len(traced) == 4
