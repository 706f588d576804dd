"""One way to choose by name, and one problem record.

`where` chooses the layers of `tt.lora`, `tt.merge_lora`, `tt.quantize` and `tt.dequantize`
alike (a pattern, a list of them or a function), with the patterns of `tt.by_name` and
`tt.shard`; every pattern that matches nothing is named, with the closest names, in one
`tt.SelectionError` of `tt.StateProblem` records, and so is a call that would change
nothing; the old keywords (`targets=`, `filter=`) still work with a FutureWarning, which
Python shows by default. A load's, a conversion's and a selection's problems are one
record with one message form."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _child import HOST_WARNING, cpu_environment

import taktiny as tt
from taktiny import convert as cv
from taktiny import nn
from taktiny._problems import ProblemsError


class Block(nn.Module):
    def __init__(self, *, rngs):
        self.up = nn.Linear(4, 8, rngs=rngs)
        self.down = nn.Linear(8, 4, rngs=rngs)
        self.norm = nn.LayerNorm(4)


class Net(nn.Module):
    def __init__(self, *, rngs):
        self.embed = nn.Embed(10, 4, rngs=rngs)
        self.blocks = [Block(rngs=rngs) for _ in range(2)]
        self.head = nn.Linear(4, 3, rngs=rngs)


LAYERS = ["embed", "blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down", "head"]


def layer_types(model):
    return {name: type(layer).__name__ for name, layer in layers_of(model).items()}


def layers_of(model):
    blocks = {f"blocks.{i}.{n}": getattr(b, n) for i, b in enumerate(model.blocks) for n in ("up", "down")}  # fmt: skip
    return {"embed": model.embed, **blocks, "head": model.head}


def chosen_by(before, after):
    """The names of the layers whose type changed from `before` to `after`."""
    old, new = layer_types(before), layer_types(after)
    return [name for name in LAYERS if old[name] != new[name]]


def lora(model, **kw):
    return tt.lora(model, 2, rngs=nn.Rngs(1), **kw)


# each call: (the call, a model it can change every layer of)
CALLS = {
    "lora": (lora, lambda: Net(rngs=nn.Rngs(0))),
    "merge_lora": (tt.merge_lora, lambda: lora(Net(rngs=nn.Rngs(0)), where="**")),
    "quantize": (tt.quantize, lambda: Net(rngs=nn.Rngs(0))),
    "dequantize": (tt.dequantize, lambda: tt.quantize(Net(rngs=nn.Rngs(0)))),
}
SELECTIONS = [
    ("blocks.*.up", ["blocks.0.up", "blocks.1.up"]),
    (["head", "blocks.1.*"], ["blocks.1.up", "blocks.1.down", "head"]),
    (("embed", "**.down"), ["embed", "blocks.0.down", "blocks.1.down"]),
    (lambda name, layer: name.endswith("up") or name == "embed", ["embed", "blocks.0.up", "blocks.1.up"]),
]  # fmt: skip


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize(("where", "expected"), SELECTIONS)
def test_where_chooses_the_same_layers_in_every_call_that_swaps_them(call, where, expected):
    swap, make = CALLS[call]
    model = make()
    out = swap(model, where=where)
    assert chosen_by(model, out) == expected
    for name, layer in layers_of(out).items():  # the layers left alone: the same objects
        if name not in expected:
            assert layer is layers_of(model)[name]


@pytest.mark.parametrize("call", ["merge_lora", "quantize", "dequantize"])
def test_without_where_every_layer_a_call_can_change_is_changed(call):
    swap, make = CALLS[call]
    model = make()
    assert chosen_by(model, swap(model)) == LAYERS


def test_a_predicate_sees_each_candidate_layer_in_order_with_its_name():
    model = CALLS["dequantize"][1]()
    seen = []
    out = tt.dequantize(model, where=lambda name, layer: seen.append((name, layer)) or False)
    assert [name for name, _ in seen] == LAYERS
    seen_layers = [layer for _, layer in seen]  # (a function may choose none: all stay)
    assert all(a is b for a, b in zip(seen_layers, layers_of(model).values(), strict=True))
    assert isinstance(seen[0][1], nn.QuantizedEmbed) and out is not model  # a new model
    assert all(a is b for a, b in zip(layers_of(out).values(), seen_layers, strict=True))


# the old keywords: (call, keyword, model maker)
OLD = [
    (lora, "targets", CALLS["lora"][1]),
    (tt.quantize, "filter", CALLS["quantize"][1]),
]


@pytest.mark.parametrize(("swap", "old", "make"), OLD)
def test_the_old_keywords_still_choose_and_warn_naming_where(swap, old, make):
    model = make()
    call = "taktiny.lora" if old == "targets" else "taktiny.quantize"
    message = rf"^{call}: {old}= is now where= \(the same patterns, or a function \(name, layer\) -> bool\); {old}= goes in the next release\.$"  # fmt: skip
    with pytest.warns(FutureWarning, match=message):
        out = swap(model, **{old: "blocks.*.up"})
    assert chosen_by(model, out) == ["blocks.0.up", "blocks.1.up"]
    with pytest.raises(TypeError, match=rf"^{call}: pass the selection once, as where=; {old}="):
        swap(model, where="head", **{old: "head"})


def test_deprecations_are_shown_by_default_from_a_users_module(tmp_path):
    """The old keywords and the old problem forms warn with a FutureWarning, which a
    fresh interpreter under Python's default filters shows though the call is in an
    imported module (a DeprecationWarning there is hidden). Seen to fail with
    DeprecationWarning (nothing printed)."""
    (tmp_path / "user_code.py").write_text(
        "import taktiny as tt\n"
        "from taktiny import nn\n"
        "def run():\n"
        "    tt.quantize({'head': nn.Linear(4, 3, rngs=nn.Rngs(0))}, filter='head')\n"
        "    tt.StateProblem('shape', key='a', hint='h')\n"
    )
    # Python's default filters, but for the host's warning at JAX's import (tests/_child.py)
    path = os.pathsep.join([str(tmp_path), *sys.path])
    env = cpu_environment(PYTHONWARNINGS=HOST_WARNING, PYTHONPATH=path)
    done = subprocess.run(
        [sys.executable, "-c", "import user_code; user_code.run()"],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    warned = [line for line in done.stderr.splitlines() if "Warning: " in line]
    assert warned == [
        f"{tmp_path / 'user_code.py'}:4: FutureWarning: taktiny.quantize: filter= is now "
        "where= (the same patterns, or a function (name, layer) -> bool); filter= goes in "
        "the next release.",
        f"{tmp_path / 'user_code.py'}:5: FutureWarning: StateProblem.key is now "
        "StateProblem.name (the same flat name, as ConversionProblem calls it); read and "
        "pass name. key goes in the next release.",
    ]


def test_a_call_that_would_change_nothing_is_refused_saying_what_the_model_holds():
    """tt.dequantize, tt.merge_lora and tt.quantize choosing every layer (where=None) of
    a model that holds none they change raise, naming what they found instead, rather
    than give the model back as it was. Seen to fail with the check removed."""
    plain, quantized = Net(rngs=nn.Rngs(0)), tt.quantize(Net(rngs=nn.Rngs(0)))
    cases = [
        (tt.dequantize, plain, "taktiny.dequantize", "QuantizedLinear or QuantizedEmbed layer, "
         "nor LoRA layer on a quantized weight", "its Embed layer 'embed' is not quantized; its "
         "Linear layers 'blocks.0.up', 'blocks.0.down', 'blocks.1.up', 'blocks.1.down' and 1 "
         "more are not quantized."),
        (tt.merge_lora, quantized, "taktiny.merge_lora", "LoRALinear or LoRAEmbed layer", "its "
         "QuantizedEmbed layer 'embed' has no adapter; its QuantizedLinear layers 'blocks.0.up', "
         "'blocks.0.down', 'blocks.1.up', 'blocks.1.down' and 1 more have no adapter."),
        (tt.quantize, quantized, "taktiny.quantize", "Linear or Embed layer", "its QuantizedEmbed "
         "layer 'embed' is quantized already; its QuantizedLinear layers 'blocks.0.up', "
         "'blocks.0.down', 'blocks.1.up', 'blocks.1.down' and 1 more are quantized already."),
        (tt.merge_lora, {"norm": nn.LayerNorm(4)}, "taktiny.merge_lora", "LoRALinear or LoRAEmbed "
         "layer", ""),
    ]  # fmt: skip
    for call, model, name, what, found in cases:
        with pytest.raises(tt.SelectionError) as info:
            call(model)
        assert str(info.value) == (
            f"{name} on {type(model).__name__}: 1 problem:\n  - '**': matches no {what}; "
            f"where=None chooses every one, and the model has none, so this call would change "
            f"nothing{'; ' + found if found else '.'}"
        )
        assert [(p.kind, p.name, p.expected) for p in info.value.problems] == [
            ("unmatched", "**", what)
        ]
    adapted = tt.lora(
        plain, 2, where="head", rngs=nn.Rngs(1)
    )  # a float base: nothing to dequantize
    with pytest.raises(
        tt.SelectionError,
        match=r"its LoRALinear layer 'head' adapts a float weight, which is not quantized\.$",
    ):
        tt.dequantize(adapted)


# each call, a pattern that matches nothing, and what the message says of it
UNMATCHED = {
    "lora": ("blocks.*.upp", "Linear, QuantizedLinear, Embed or QuantizedEmbed layer",
             "did you mean 'blocks.*.up'?"),
    "merge_lora": ("haed", "LoRALinear or LoRAEmbed layer", "did you mean 'head'?"),
    "quantize": ("blokcs.0.down", "Linear or Embed layer", "did you mean 'blocks.0.down'?"),
    "dequantize": ("embd", "QuantizedLinear or QuantizedEmbed layer, nor LoRA layer on a quantized weight", "did you mean 'embed'?"),
}  # fmt: skip


@pytest.mark.parametrize("call", CALLS)
def test_each_pattern_that_matches_nothing_is_named_with_the_closest_layer(call):
    swap, make = CALLS[call]
    model = make()
    pattern, what, hint = UNMATCHED[call]
    with pytest.raises(tt.SelectionError) as info:
        swap(model, where=["head", pattern, "blocks.1.nrom", "xyz"])
    assert str(info.value).splitlines() == [
        f"taktiny.{call} on Net: 3 problems:",
        f"  - {pattern!r}: matches no {what}; {hint}",
        f"  - 'blocks.1.nrom': matches no {what}; did you mean 'blocks.1.down'?",
        f"  - 'xyz': matches no {what}; no name is close to it; the layers it may name: "
        f"'embed', 'blocks.0.up', 'blocks.0.down', 'blocks.1.up' and 2 more.",
    ]
    assert [(p.kind, p.name, p.expected, p.got) for p in info.value.problems] == [
        ("unmatched", name, what, None) for name in (pattern, "blocks.1.nrom", "xyz")
    ]
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("call", CALLS)
def test_a_pattern_that_names_another_kind_of_module_says_what_it_names(call):
    swap, make = CALLS[call]
    model = make()
    with pytest.raises(tt.SelectionError, match=r"  - 'blocks\.0\.norm': .*; it matches "
                       r"'blocks\.0\.norm', a LayerNorm\.$"):  # fmt: skip
        swap(model, where="blocks.0.norm")
    with pytest.raises(tt.SelectionError, match=r"  - 'blocks\.1': .*; it matches 'blocks\.1', "
                       r"a Block; name the layers inside it \('blocks\.1\.\*' or "
                       r"'blocks\.1\.\*\*'\)\.$"):  # fmt: skip
        swap(model, where="blocks.1")
    with pytest.raises(tt.SelectionError, match=r"it matches the parameter 'head\.bias', not "
                       r"a layer; name the layer \('head'\)\.$"):  # fmt: skip
        swap(model, where="head.bias")
    with pytest.raises(TypeError, match=rf"^taktiny\.{call}: where is a pattern over layer "
                       r"names \('\*\*\.attention\.\*'\), a non-empty list of them, or a "
                       r"function \(name, layer\) -> bool; got \[\]\.$"):  # fmt: skip
        swap(model, where=[])


def test_a_pattern_naming_a_layer_already_changed_says_so():
    adapted, quantized, plain = CALLS["merge_lora"][1](), tt.quantize(Net(rngs=nn.Rngs(0))), Net(rngs=nn.Rngs(0))  # fmt: skip
    cases = [
        (lora, adapted, "it matches 'head', a LoRALinear, which already has an adapter; merge "
         "it first (taktiny.merge_lora) or leave it out of where."),
        (tt.merge_lora, plain, "it matches 'head', a Linear, which has no adapter."),
        (tt.quantize, quantized, "it matches 'head', a QuantizedLinear, which is quantized "
         "already."),
        (tt.dequantize, plain, "it matches 'head', a Linear, which is not quantized."),
    ]  # fmt: skip
    for swap, model, hint in cases:
        with pytest.raises(tt.SelectionError) as info:
            swap(model, where="head")
        (problem,) = info.value.problems
        assert problem.hint.endswith(hint), (swap, problem.hint)


def test_rules_that_match_nothing_are_named_by_the_same_code_in_by_name_and_shard():
    model = Net(rngs=nn.Rngs(0))
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    rules = {"blocks.*.up.kernel": 0, "haed.**": 1, "blocks.*.up.kernel.x": 2}
    expected = [
        ("unmatched", "haed.**", "name", "matches no name; did you mean 'head.**'?"),
        ("unmatched", "blocks.*.up.kernel.x", "name"),
    ]
    for call, run in [
        ("taktiny.by_name", lambda: tt.by_name(rules, default=0)(model)),
        ("taktiny.sharding_plan", lambda: tt.shard(model, dict.fromkeys(rules, ()), mesh)),
    ]:
        with pytest.raises(tt.SelectionError, match=rf"^{call} on Net: 2 problems:\n") as info:
            run()
        got = [(p.kind, p.name, p.expected, p.hint) for p in info.value.problems]
        assert got[0] == expected[0]
        assert got[1][:3] == expected[1][:3]
        assert str(info.value).splitlines()[1:] == [f"  - {p}" for p in info.value.problems]
    with pytest.raises(tt.SelectionError, match=r"  - 'haed\.\*\*': matches no Linear or "
                       r"Embed layer; did you mean 'head\.\*\*'\?"):  # fmt: skip
        tt.quantize(model, where="haed.**")


def test_a_selection_error_shows_twenty_problems_and_keeps_them_all():
    tree = {f"p{i:02d}": jnp.ones(1) for i in range(25)}
    with pytest.raises(tt.SelectionError) as info:
        tt.by_name({"q": 1})(tree)
    lines = str(info.value).splitlines()
    assert lines[0] == "taktiny.by_name on dict: 26 problems:"
    assert lines[1] == "  - 'q': matches no name; no name is close to it."
    assert lines[2] == (
        "  - 'p00': no rule matches it; add a rule for it (a last rule '**' matches "
        "everything), or pass default= (the value of the names no rule matches)."
    )
    assert len(lines) == 22 and lines[-1] == "  ... and 6 more (all in .problems)"
    assert [p.name for p in info.value.problems[1:]] == list(tree)


# --- One record -------------------------------------------------------------------


def test_state_conversion_and_selection_problems_are_one_record():
    assert cv.ConversionProblem is tt.StateProblem
    fields = [f.name for f in dataclasses.fields(tt.StateProblem)]
    assert fields == ["kind", "name", "expected", "got", "hint"]
    with pytest.raises(tt.StateDictError) as load:
        nn.Linear(2, 3, rngs=nn.Rngs(0)).load_state_dict({"kernel": np.zeros((3, 2))})
    with pytest.raises(cv.ConversionError) as conversion:
        cv.convert([cv.Rule("w", "kernel")], {"w": np.zeros((3, 2))}, target=nn.Linear(2, 3, rngs=nn.Rngs(0)), allow={"missing": ["bias"]})  # fmt: skip
    with pytest.raises(tt.SelectionError) as selection:
        tt.quantize({"fc": nn.Linear(2, 3, rngs=nn.Rngs(0))}, where="fc.kernel")
    problems = [e.value.problems[0] for e in (load, conversion, selection)]
    assert [type(p) for p in problems] == [tt.StateProblem] * 3
    assert [(p.kind, p.name, p.expected, p.got) for p in problems] == [
        ("shape", "kernel", (2, 3), (3, 2)),
        ("shape", "kernel", "float32[2, 3]", "float32[3, 2]"),
        ("unmatched", "fc.kernel", "Linear or Embed layer", None),
    ]
    assert [str(p) for p in problems] == [
        "'kernel': shape mismatch: expected (2, 3), got (3, 2).",
        "'kernel': shape mismatch: the target holds float32[2, 3], the rule makes "
        "float32[3, 2] from ['w']; fix its transform.",
        "'fc.kernel': matches no Linear or Embed layer; it matches the parameter 'fc.kernel', "
        "not a layer; name the layer ('fc').",
    ]
    for error in (load, conversion, selection):
        assert str(error.value).splitlines()[1] == f"  - {error.value.problems[0]}"
        assert isinstance(error.value, ProblemsError)  # (one error base lists them all)


def test_the_old_key_and_the_old_conversion_form_still_work_with_a_warning():
    problem = tt.StateProblem("shape", "a.b", (2,), (3,), "shape mismatch.")
    with pytest.warns(FutureWarning, match=r"^StateProblem\.key is now StateProblem\.name"):
        assert problem.key == "a.b"
    with pytest.warns(FutureWarning, match=r"^StateProblem\.key is now StateProblem\.name"):
        made = tt.StateProblem("shape", key="a.b", expected=(2,), got=(3,), hint="shape mismatch.")
    assert made == problem
    with pytest.raises(TypeError, match=r"^StateProblem takes the name once"):
        tt.StateProblem("shape", "a.b", hint="x", key="a.b")
    with pytest.warns(FutureWarning, match=r"^ConversionProblem\(kind, name, hint\) is now"):
        old = cv.ConversionProblem("tie", "h", "is tied to 'e', but their values differ.")
    assert old == cv.ConversionProblem("tie", "h", hint="is tied to 'e', but their values differ.")
    assert (old.expected, old.got, str(old)) == (
        None,
        None,
        "'h': is tied to 'e', but their values differ.",
    )
    with pytest.raises(TypeError, match=r"needs a name and a hint, got name='h', hint=None"):
        tt.StateProblem("tie", "h")
    error = tt.StateDictError("f()", [tt.StateProblem("missing", "w", hint="missing.")])
    assert error.missing_keys == ("w",)  # (read through name: no warning)
