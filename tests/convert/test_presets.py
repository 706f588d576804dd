"""The presets of `taktiny.convert` against PyTorch and transformers: each converts a random
torch model, matches its outputs, exports back into a fresh torch model loaded with
strict=True and matches again; and the parity helper that proves it."""

import copy
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _torch import numpy, randomize_

from taktiny import convert as cv
from taktiny import nn

RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _full_float32_products():
    """The comparisons with torch hold at full float32 precision, which a GPU's default
    (TF32 matmuls) does not give: pinned for every test here."""
    with jax.default_matmul_precision("highest"):
        yield


def randn(*shape):
    return RNG.standard_normal(shape, dtype=np.float32)


def first_to_last(x):
    """torch's [N, C, *spatial] -> Taktiny's [N, *spatial, C]."""
    return numpy(x.movedim(1, -1))


def to_torch(flat):
    return {name: torch.from_numpy(np.array(value)) for name, value in flat.items()}


def load_torch_like(theirs, exported):
    """A copy of `theirs` with other random values, then `exported` loaded strictly."""
    fresh = randomize_(copy.deepcopy(theirs), seed=1)
    fresh.load_state_dict(to_torch(exported), strict=True)
    return fresh


def convert_and_back(rules, theirs, factory, ours_fn, theirs_fn, *inputs, tolerance=1e-5):
    """Converts `theirs` by `rules` into `factory()`, matches outputs, exports back into a
    fresh torch module and matches again; returns the converted model."""
    target = jax.eval_shape(factory)
    model = target.load_flat_state_dict(
        cv.convert(rules, theirs.state_dict(), target=target), strict=True
    )
    cv.parity(lambda *x: ours_fn(model, *x), lambda *x: theirs_fn(theirs, *x), *inputs,
              tolerance=tolerance)  # fmt: skip
    exported = cv.export(rules, model)
    fresh = load_torch_like(theirs, exported)
    cv.parity(lambda *x: ours_fn(model, *x), lambda *x: theirs_fn(fresh, *x), *inputs,
              tolerance=tolerance)  # fmt: skip
    return model


def channels(module, x):
    return first_to_last(module(torch.from_numpy(np.moveaxis(x, -1, 1))))


def call(module, *x):
    return module(*map(jnp.asarray, x))


def call_torch(module, *x):
    return module(*map(torch.from_numpy, x))


# (torch module, Taktiny factory, the preset's rules, input)
LAYERS = {
    "linear": (torch.nn.Linear(5, 7), lambda: nn.Linear(5, 7, rngs=nn.Rngs(0)),
               cv.linear("", ""), randn(3, 5)),
    "linear without bias": (torch.nn.Linear(5, 7, bias=False),
                            lambda: nn.Linear(5, 7, use_bias=False, rngs=nn.Rngs(0)),
                            cv.linear("", "", bias=False), randn(3, 5)),
    "layer_norm": (torch.nn.LayerNorm(6), lambda: nn.LayerNorm(6, epsilon=1e-5),
                   cv.layer_norm("", ""), randn(2, 3, 6)),
    "layer_norm without bias": (torch.nn.LayerNorm(6, bias=False),
                                lambda: nn.LayerNorm(6, epsilon=1e-5, use_bias=False),
                                cv.layer_norm("", "", bias=False), randn(2, 6)),
    "rms_norm": (torch.nn.RMSNorm(6, eps=1e-6), lambda: nn.RMSNorm(6, epsilon=1e-6),
                 cv.layer_norm("", "", bias=False), randn(2, 6)),
    "embedding": (torch.nn.Embedding(11, 4), lambda: nn.Embed(11, 4, rngs=nn.Rngs(0)),
                  cv.embedding("", ""), RNG.integers(0, 11, (2, 5))),
    "group_norm": (torch.nn.GroupNorm(3, 6), lambda: nn.GroupNorm(3, 6),
                   cv.group_norm("", ""), randn(4, 6)),  # [batch, channels]: either layout
}  # fmt: skip


@pytest.mark.parametrize("case", LAYERS)
def test_a_layer_preset_converts_and_exports_back(case):
    theirs, factory, rules, x = LAYERS[case]
    model = convert_and_back(rules, randomize_(theirs), factory, call, call_torch, x)
    cv.round_trip_check(rules, model)
    assert [repr(r) for r in cv.pytorch(model)] == [repr(r) for r in [*rules, *cv.buffers()]]


CONVS = [  # (kernel_size, groups, transposed)
    ((3,), 3, False), ((3, 2), 1, False), ((2, 3, 2), 3, False),
    ((3,), 1, True), ((3, 4), 3, True), ((2, 2, 3), 1, True),
]  # fmt: skip


@pytest.mark.parametrize("kernel_size, groups, transposed", CONVS)
def test_conv_presets_permute_and_mirror_the_kernel(kernel_size, groups, transposed):
    n = len(kernel_size)
    kind = "ConvTranspose" if transposed else "Conv"
    theirs = getattr(torch.nn, f"{kind}{n}d")(6, 9, kernel_size, stride=2, groups=groups)
    if transposed:
        rules = cv.conv_transpose("", "", dims=n, groups=groups, in_features=6, out_features=9)
        factory = lambda: nn.ConvTranspose(
            6, 9, kernel_size, strides=2, padding="VALID", feature_group_count=groups,
            rngs=nn.Rngs(0))  # fmt: skip
    else:
        rules = cv.conv("", "", dims=n)
        factory = lambda: nn.Conv(6, 9, kernel_size, strides=2, padding="VALID",
                                  feature_group_count=groups, rngs=nn.Rngs(0))  # fmt: skip
    x = randn(2, *(5,) * n, 6)
    model = convert_and_back(rules, randomize_(theirs), factory, call, channels, x)
    cv.round_trip_check(rules, model)
    assert [repr(r) for r in cv.pytorch(model)] == [repr(r) for r in [*rules, *cv.buffers()]]


def test_presets_put_their_rules_under_the_prefixes_given():
    """Each preset at a source and a target prefix, with its defaults and its options."""
    shown = lambda rules: [repr(r) for r in rules]
    K, B, ID = "'e.{i}.weight' -> 'b.{i}.kernel'", "'e.{i}.bias' -> 'b.{i}.bias'", "identity()"
    assert shown(cv.linear("e.{i}", "b.{i}")) == [f"Rule({K}, transpose())", f"Rule({B}, {ID})"]
    assert shown(cv.linear("e.{i}", "b.{i}", bias=False)) == [f"Rule({K}, transpose())"]
    assert shown(cv.conv("e.{i}", "b.{i}", dims=2)) == [
        f"Rule({K}, transpose((2, 3, 1, 0)))", f"Rule({B}, {ID})"]  # fmt: skip
    assert shown(cv.conv("e.{i}", "b.{i}", dims=1, bias=False)) == [f"Rule({K}, transpose((2, 1, 0)))"]  # fmt: skip
    assert shown(cv.conv_transpose("e.{i}", "b.{i}", dims=1)) == [  # one group by default
        f"Rule({K}, chain(transpose((2, 0, 1)), flip((0,))))", f"Rule({B}, {ID})"]  # fmt: skip
    grouped = cv.conv_transpose("e.{i}", "b.{i}", dims=2, groups=3, in_features=6, out_features=9)
    assert shown(grouped) == [
        f"Rule({K}, chain(split(axis=0, sizes=(2, 2, 2)), concatenate(axis=1, sizes=(3, 3, 3)), "
        "transpose((2, 3, 0, 1)), flip((0, 1))))",
        f"Rule({B}, {ID})",
    ]
    assert shown(cv.layer_norm("e.{i}", "b.{i}")) == [
        f"Rule('e.{{i}}.weight' -> 'b.{{i}}.scale', {ID})", f"Rule({B}, {ID})"]  # fmt: skip
    assert shown(cv.layer_norm("e.{i}", "b.{i}", scale=False)) == [f"Rule({B}, {ID})"]
    assert shown(cv.group_norm("e.{i}", "b.{i}", bias=False)) == [
        f"Rule('e.{{i}}.weight' -> 'b.{{i}}.scale', {ID})"]  # fmt: skip
    assert shown(cv.group_norm("e.{i}", "b.{i}", scale=False)) == [f"Rule({B}, {ID})"]
    assert shown(cv.embedding("e.{i}", "b.{i}")) == [
        f"Rule('e.{{i}}.weight' -> 'b.{{i}}.embedding', {ID})"]  # fmt: skip
    assert shown(cv.batch_norm("e.{i}", "b.{i}")) == [
        f"Rule('e.{{i}}.{s}' -> 'b.{{i}}.{t}', {ID})"
        for s, t in [("weight", "scale"), ("bias", "bias"), ("running_mean", "mean"),
                     ("running_var", "var")]
    ] + ["Ignore('e.{i}.num_batches_tracked', export=array(0))"]  # fmt: skip
    qkv = lambda part: [f"'b.{{i}}.{p}.{part}'" for p in ("query", "key", "value")]
    assert shown(cv.multihead_attention("e.{i}", "b.{i}")) == [  # fused, with biases
        f"Rule('e.{{i}}.in_proj_weight' -> [{', '.join(qkv('kernel'))}], chain(split(axis=0), "
        "transpose()))",
        f"Rule('e.{{i}}.in_proj_bias' -> [{', '.join(qkv('bias'))}], split(axis=0))",
        "Rule('e.{i}.out_proj.weight' -> 'b.{i}.out.kernel', transpose())",
        f"Rule('e.{{i}}.out_proj.bias' -> 'b.{{i}}.out.bias', {ID})",
    ]
    assert shown(cv.multihead_attention("e.{i}", "b.{i}", fused=False, bias=False)) == [
        *(f"Rule('e.{{i}}.{p}_proj_weight' -> {k}, transpose())"
          for p, k in zip("qkv", qkv("kernel"), strict=True)),
        "Rule('e.{i}.out_proj.weight' -> 'b.{i}.out.kernel', transpose())",
    ]  # fmt: skip


def test_a_grouped_conv_transpose_needs_its_features():
    with pytest.raises(ValueError, match=r"conv_transpose\('up', 'up'\) with groups=2 needs in_f"):
        cv.conv_transpose("up", "up", dims=2, groups=2)
    with pytest.raises(ValueError, match=r"with groups=2 needs in_features and out_features"):
        cv.conv_transpose("up", "up", dims=2, groups=2, in_features=4)
    with pytest.raises(ValueError, match=r"with groups=3 needs in_features and out_features"):
        cv.conv_transpose("up", "up", dims=2, groups=3, out_features=6)
    with pytest.raises(
        ValueError, match=r"dims is the number of spatial axes of the kernel, got 0"
    ):
        cv.conv("c", "c", dims=0)
    # Conv's limit, 22 spatial axes, is the last one taken
    widest = (*range(2, 24), 1, 0)
    assert [repr(r) for r in cv.conv("c", "c", dims=22, bias=False)] == [
        f"Rule('c.weight' -> 'c.kernel', transpose({widest}))"]  # fmt: skip
    with pytest.raises(ValueError, match=r"spatial axes of the kernel, got 23\.$"):
        cv.conv("c", "c", dims=23)


def test_group_norm_and_pools_take_their_places_in_a_sequential():
    """A GroupNorm on channels-last images gets its preset; pools have no state but count
    in the numbering, as in torch."""
    theirs = torch.nn.Sequential(
        torch.nn.Conv2d(3, 6, 3, padding=1), torch.nn.GroupNorm(3, 6), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()),
        torch.nn.Linear(6, 2),
    )  # fmt: skip
    factory = lambda: nn.Sequential(
        nn.Conv(3, 6, (3, 3), padding=1, rngs=nn.Rngs(0)), nn.GroupNorm(3, 6), jax.nn.relu,
        nn.MaxPool((2, 2)), nn.GlobalAvgPool(), nn.Linear(6, 2, rngs=nn.Rngs(1)),
    )  # fmt: skip
    rules = cv.pytorch(jax.eval_shape(factory))
    assert [repr(r) for r in rules[2:4]] == [repr(r) for r in cv.group_norm("1", "layers.1")]
    assert isinstance(last := rules[-2], cv.Rule) and last.sources == ("5.bias",)
    x = randn(2, 6, 5, 3)
    model = convert_and_back(rules, randomize_(theirs), factory, call, channels, x)
    cv.round_trip_check(rules, model)


def test_batch_norm_converts_the_running_statistics_and_ignores_the_count():
    theirs = randomize_(torch.nn.BatchNorm2d(5, eps=1e-3))
    theirs.get_buffer("num_batches_tracked").fill_(7)
    rules = cv.batch_norm("", "")
    x = randn(2, 4, 3, 5)
    model = convert_and_back(rules, theirs, lambda: nn.BatchNorm(5, epsilon=1e-3), call,
                             channels, x)  # fmt: skip
    np.testing.assert_array_equal(model.var, numpy(theirs.get_buffer("running_var")))
    count = cv.export(rules, model)["num_batches_tracked"]  # for strict readers: 0
    assert count.dtype == np.int64 and count.shape == () and count == 0
    cv.round_trip_check(rules, model)


@pytest.mark.parametrize("kdim, bias", [(None, True), (6, True), (6, False), (None, False)])
def test_multihead_attention_splits_in_proj_into_query_key_and_value(kdim, bias):
    theirs = torch.nn.MultiheadAttention(8, 2, bias=bias, kdim=kdim, vdim=kdim, batch_first=True)
    rules = cv.multihead_attention("", "", fused=kdim is None, bias=bias)
    factory = lambda: nn.MultiHeadAttention(2, 8, kv_features=kdim, use_bias=bias, rngs=nn.Rngs(0))
    q, kv = randn(2, 5, 8), randn(2, 7, kdim or 8)
    attend = lambda module, q, kv: module(*map(torch.from_numpy, (q, kv, kv)), need_weights=False)
    model = convert_and_back(rules, randomize_(theirs), factory, call, attend, q, kv)
    cv.round_trip_check(rules, model)
    assert [repr(r) for r in cv.pytorch(model)] == [repr(r) for r in [*rules, *cv.buffers()]]


def test_pytorch_numbers_a_sequential_as_torch_does():
    theirs = torch.nn.Sequential(
        torch.nn.Embedding(10, 8), torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.LayerNorm(6),
        torch.nn.Linear(6, 3),
    )  # fmt: skip
    factory = lambda: nn.Sequential(
        nn.Embed(10, 8, rngs=nn.Rngs(0)), nn.Linear(8, 6, rngs=nn.Rngs(1)), jax.nn.relu,
        nn.LayerNorm(6, epsilon=1e-5), nn.Linear(6, 3, rngs=nn.Rngs(2)),
    )  # fmt: skip
    rules = cv.pytorch(jax.eval_shape(factory))
    assert [(r.sources, r.targets) for r in rules[-3:] if isinstance(r, cv.Rule)] == [
        (("4.weight",), ("layers.4.kernel",)),
        (("4.bias",), ("layers.4.bias",)),
    ]
    ids = RNG.integers(0, 10, (2, 5))
    model = convert_and_back(rules, randomize_(theirs), factory, call, call_torch, ids)
    cv.round_trip_check(rules, model)


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.features = torch.nn.Sequential(conv, torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])
        self.head = torch.nn.ModuleDict(
            {"norm": torch.nn.LayerNorm(8), "out": torch.nn.Linear(8, 4)}
        )

    def forward(self, x):  # [batch, channels, height, width]
        h = self.features(x).mean((2, 3))
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.head["out"](self.head["norm"](h))


class Net(nn.Module):
    def __init__(self, *, rngs):
        conv = nn.Conv(3, 8, (3, 3), padding=1, rngs=rngs)
        self.features = nn.Sequential(conv, nn.BatchNorm(8, epsilon=1e-5), jax.nn.relu)
        self.blocks = [nn.Linear(8, 8, rngs=rngs), nn.Linear(8, 8, rngs=rngs)]
        self.head = {"norm": nn.LayerNorm(8, epsilon=1e-5), "out": nn.Linear(8, 4, rngs=rngs)}

    def __call__(self, x):  # [batch, height, width, channels]
        h = self.features(x).mean((1, 2))
        for block in self.blocks:
            h = jax.nn.relu(block(h))
        return self.head["out"](self.head["norm"](h))


def test_pytorch_walks_attributes_lists_dicts_and_sequentials_under_prefixes():
    theirs = randomize_(TorchNet())
    model = jax.eval_shape(lambda: Net(rngs=nn.Rngs(0)))
    rules = cv.pytorch(model)
    named = {r.sources[0]: getattr(r, "targets", None) for r in rules}
    assert named["features.0.weight"] == ("features.layers.0.kernel",)
    assert named["features.1.running_var"] == ("features.layers.1.var",)
    assert named["features.1.num_batches_tracked"] is None  # an Ignore
    assert named["blocks.1.weight"] == ("blocks.1.kernel",)
    assert named["head.norm.weight"] == ("head.norm.scale",)
    assert len(rules) - 1 == len(theirs.state_dict()) == 15  # and last, the buffers' Ignore
    assert repr(rules[-1]) == repr(cv.buffers()[0])
    prefixed = cv.pytorch(model.blocks, "backbone.{i}", "net.{i}")
    assert [r.sources[0] for r in prefixed][:2] == ["backbone.{i}.0.weight", "backbone.{i}.0.bias"]
    assert isinstance(bias := prefixed[3], cv.Rule) and bias.targets == ("net.{i}.1.bias",)
    x = randn(2, 6, 5, 3)
    model = convert_and_back(rules, theirs, lambda: Net(rngs=nn.Rngs(0)), call, channels, x)
    cv.round_trip_check(rules, model)  # the Ignore has nothing to match on the way back


class Mixed(nn.Module):
    """A layer of each preset kind, each with an option that changes its rules."""

    def __init__(self, *, rngs):
        self.conv = nn.Conv(3, 4, (3,), use_bias=False, rngs=rngs)
        self.up = nn.ConvTranspose(4, 6, (3,), feature_group_count=2, use_bias=False, rngs=rngs)
        self.norms = {
            "ln": nn.LayerNorm(6, use_scale=False),
            "gn": nn.GroupNorm(3, 6, use_scale=False),
            "gn_nobias": nn.GroupNorm(3, 6, use_bias=False),
            "rms": nn.RMSNorm(6),
        }
        # query [6, 8]: not square, and still fused (the key reads the queries' inputs)
        self.attn = nn.MultiHeadAttention(2, 6, qkv_features=8, use_bias=False, rngs=rngs)


def test_pytorch_gives_each_layer_its_preset_with_its_options_under_the_prefixes():
    model = jax.eval_shape(lambda: Mixed(rngs=nn.Rngs(0)))
    expected = [
        *cv.conv("src.conv", "dst.conv", dims=1, bias=False),
        *cv.conv_transpose("src.up", "dst.up", dims=1, groups=2, in_features=4, out_features=6,
                           bias=False),
        *cv.group_norm("src.norms.gn", "dst.norms.gn", scale=False),  # (a dict's keys sorted)
        *cv.group_norm("src.norms.gn_nobias", "dst.norms.gn_nobias", bias=False),
        *cv.layer_norm("src.norms.ln", "dst.norms.ln", scale=False),
        *cv.layer_norm("src.norms.rms", "dst.norms.rms", bias=False),
        *cv.multihead_attention("src.attn", "dst.attn", fused=True, bias=False),
    ]  # fmt: skip
    got = [repr(r) for r in cv.pytorch(model, "src", "dst")]
    assert got == [repr(r) for r in [*expected, *cv.buffers()]]
    assert got[1] == (
        "Rule('src.up.weight' -> 'dst.up.kernel', chain(split(axis=0, sizes=(2, 2)), "
        "concatenate(axis=1, sizes=(3, 3)), transpose((2, 0, 1)), flip((0,))))"
    )
    assert got[2:5] == [
        "Rule('src.norms.gn.bias' -> 'dst.norms.gn.bias', identity())",
        "Rule('src.norms.gn_nobias.weight' -> 'dst.norms.gn_nobias.scale', identity())",
        "Rule('src.norms.ln.bias' -> 'dst.norms.ln.bias', identity())",
    ]


class Custom(nn.Module):
    def __init__(self):
        self.gain = jnp.ones(3)
        self.proj = nn.Linear(3, 3, rngs=nn.Rngs(0))


def test_arrays_of_modules_without_a_preset_are_left_to_coverage():
    source = {"gain": np.ones(3, np.float32), "proj.weight": randn(3, 3), "proj.bias": randn(3)}
    rules = cv.pytorch(Custom())
    with pytest.raises(cv.ConversionError, match=r"2 problems") as info:
        cv.convert(rules, source, target=Custom())
    assert [(p.kind, p.name) for p in info.value.problems] == [
        ("unused", "gain"),
        ("missing", "gain"),
    ]
    flat = cv.convert([*rules, cv.Rule("gain", "gain")], source, target=Custom())
    np.testing.assert_array_equal(flat["proj.kernel"], source["proj.weight"].T)


def hf_bert():
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=24, max_position_embeddings=20,
                        attn_implementation="eager")  # fmt: skip  # pyright: ignore[reportCallIssue]
    torch.manual_seed(0)
    return config, randomize_(BertModel(config))


def test_the_bert_example_rules_convert_a_transformers_bert_and_export_it_back():
    from examples import bert

    config, theirs = hf_bert()
    ids, types = RNG.integers(0, 50, (2, 7)), RNG.integers(0, 2, (2, 7))
    valid = np.ones((2, 7), bool)
    valid[0, 4:] = False
    forward = jax.jit(lambda model, *x: model(*x))
    hf = lambda module, ids, types, valid: module(
        torch.from_numpy(ids), attention_mask=torch.from_numpy(valid).long(),
        token_type_ids=torch.from_numpy(types))  # fmt: skip
    model = convert_and_back(bert.RULES, theirs, lambda: bert.Bert(config, rngs=nn.Rngs(0)),
                             forward, hf, ids, types, valid)  # fmt: skip
    cv.round_trip_check(bert.RULES, model)


def test_the_gpt2_example_rules_split_c_attn_tie_lm_head_and_export_it_back():
    from transformers import GPT2Config, GPT2LMHeadModel

    from examples import gpt2

    config = GPT2Config(vocab_size=50, n_positions=20, n_embd=16, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0,
                        attn_implementation="eager")  # fmt: skip  # pyright: ignore[reportCallIssue]
    torch.manual_seed(0)
    theirs = randomize_(GPT2LMHeadModel(config))
    ids = RNG.integers(0, 50, (2, 9))
    forward = jax.jit(lambda model, ids: model(ids))
    hf = lambda module, ids: module(torch.from_numpy(ids), use_cache=False)
    # torch's state_dict() holds the tied copy: a Tie with export=True writes it back
    tie = cv.Tie("lm_head.weight", same_as="transformer.wte.weight", export=True)
    written = [*gpt2.RULES[:-1], tie]
    model = convert_and_back(written, theirs, lambda: gpt2.GPT2(config, rngs=nn.Rngs(0)),
                             forward, hf, ids, tolerance=1e-4)  # fmt: skip
    exported = cv.export(written, model)
    np.testing.assert_array_equal(exported["lm_head.weight"], exported["transformer.wte.weight"])
    assert sorted(cv.export(gpt2.RULES, model)) == sorted(set(exported) - {"lm_head.weight"})
    cv.round_trip_check(gpt2.RULES, model)
    cv.round_trip_check(written, model)


def test_parity_pairs_nested_outputs_in_order_and_names_them():
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    x = randn(2, 3)
    ours = lambda x: (jnp.asarray(x), {"pooled": jnp.asarray(x[:, 0]) + 1e-3})
    theirs = lambda x: BaseModelOutputWithPooling(
        last_hidden_state=torch.from_numpy(x).requires_grad_(),
        pooler_output=torch.from_numpy(x[:, 0]),
    )  # a ModelOutput drops its None fields (hidden_states)
    report = cv.parity(ours, theirs, x)
    assert [o.name for o in report.outputs] == ["last_hidden_state", "pooler_output"]
    assert [(o.ours, o.theirs) for o in report.outputs] == [((2, 3), (2, 3)), ((2,), (2,))]
    assert report.outputs[0].max_error == 0.0
    assert report.outputs[1].max_error == pytest.approx(1e-3, abs=1e-6)
    assert report.max_error == report.outputs[1].max_error
    assert repr(report) == (
        "Parity of 2 outputs:\n"
        "  last_hidden_state  [2, 3]  max abs error 0.00e+00\n"
        "  pooler_output      [2]     max abs error 1.00e-03"
    )
    # positions only on their side: our names; a lone array is "output"; None is dropped
    report = cv.parity(lambda x: {"hidden": x}, lambda x: (torch.from_numpy(x), None), x)
    assert [o.name for o in report.outputs] == ["hidden"]
    lone = cv.parity(lambda x: x, lambda x: x, x)
    assert [o.name for o in lone.outputs] == ["output"]
    assert repr(lone) == "Parity of 1 output:\n  output  [2, 3]  max abs error 0.00e+00"
    assert str(lone.outputs[0]) == "output  [2, 3]  max abs error 0.00e+00"
    nothing = cv.parity(lambda x: None, lambda x: {"past": None}, x)
    assert repr(nothing) == "Parity of 0 outputs:" and nothing.max_error == 0.0
    half = torch.from_numpy(x).to(torch.bfloat16)
    report = cv.parity(lambda x: jnp.asarray(x, jnp.bfloat16), lambda x: half, x, tolerance=0.0)
    assert report.max_error == 0.0


def test_parity_with_a_tolerance_names_every_output_over_it():
    x = randn(2, 3)
    ours = lambda x: (x, x, x, x)
    theirs = lambda x: (x + 1e-6, x + 1, x[:1], np.full_like(x, np.nan))
    report = cv.parity(ours, theirs, x)
    assert np.isnan(report.max_error) and np.isnan(report.outputs[2].max_error)
    assert "  2  ours [2, 3], theirs [1, 3]  shapes differ" in repr(report)
    assert str(report.outputs[2]) == "2  ours [2, 3], theirs [1, 3]  shapes differ"
    message = (
        r"convert.parity: 3 of 4 outputs are not within the tolerance 1e-05:\n"
        r"  - '1': max abs error 1\n"
        r"  - '2': ours \[2, 3\], theirs \[1, 3\]: shapes differ\n"
        r"  - '3': an output holds NaN\n"
        r"A missing transpose, a split in the wrong order or a wrong epsilon in the layers behind "
        r"these outputs is the usual cause; compare layer by layer\.$"
    )
    with pytest.raises(AssertionError, match=message):
        cv.parity(ours, theirs, x, tolerance=1e-5)
    assert cv.parity(ours, lambda x: (x, x, x, x + 1e-6), x, tolerance=1e-5).max_error > 0
    with pytest.raises(
        ValueError, match=r"ours gave 1 outputs \['output'\], theirs 2 \['0', '1'\]"
    ):
        cv.parity(lambda x: x, lambda x: [x, x], x)


def test_parity_catches_what_coverage_cannot_see():
    """A square Linear converted without its transpose has every shape right."""
    theirs = randomize_(torch.nn.Linear(4, 4))
    wrong = [cv.Rule("weight", "kernel"), cv.Rule("bias", "bias")]
    model = nn.Linear(4, 4, rngs=nn.Rngs(0))
    model = model.load_flat_state_dict(cv.convert(wrong, theirs.state_dict(), target=model))
    with pytest.raises(AssertionError, match=r"1 of 1 outputs .*\n  - 'output': max abs error"):
        cv.parity(lambda x: call(model, x), lambda x: call_torch(theirs, x), randn(3, 4),
                  tolerance=1e-5)  # fmt: skip


def test_parity_names_nested_outputs_by_their_paths_and_positions():
    class Pair(NamedTuple):
        logits: Any
        hidden: Any

    x = randn(2, 3)
    report = cv.parity(lambda x: {"a": {"b": x}, "c": [x]}, lambda x: ((x,), [x]), x)
    assert [o.name for o in report.outputs] == ["a.b", "c.0"]  # theirs are positions only
    report = cv.parity(lambda x: [[x, x]], lambda x: [x, x], x)  # positions on both sides
    assert [o.name for o in report.outputs] == ["0", "1"]
    report = cv.parity(lambda x: (x, x), lambda x: Pair(x, x + 1), x)
    assert [o.name for o in report.outputs] == ["logits", "hidden"]
    assert [o.max_error for o in report.outputs] == [0.0, pytest.approx(1.0, abs=1e-6)]

    class OnDevice:  # an array with a `cpu` method that is no torch tensor
        def cpu(self):
            raise AssertionError("not a tensor")

        def __array__(self, dtype=None, copy=None):
            return np.zeros((2, 3), np.float32)

    report = cv.parity(lambda x: np.zeros((2, 3), np.float32), lambda x: OnDevice(), x)
    assert report.max_error == 0.0


def test_parity_errors_of_empty_and_single_outputs():
    empty, one = np.zeros((0, 3), np.float32), np.ones(1, np.float32)
    report = cv.parity(lambda: (empty, one), lambda: (empty, one + 0.5))
    assert [o.max_error for o in report.outputs] == [0.0, 0.5]
    assert [(o.ours, o.theirs) for o in report.outputs] == [((0, 3), (0, 3)), ((1,), (1,))]
    float16 = np.full(2, 1 + 2**-10, np.float16)  # the difference is taken in float64
    assert cv.parity(lambda: float16, lambda: np.ones(2, np.float32)).max_error == 2**-10


def test_a_load_of_transformers_names_without_rules_says_to_pass_them(tmp_path):
    """Hugging Face's BERT names, loaded without rules=, differ from the model's in every
    name: the error lists them and ends by saying to pass rules=, naming the presets and
    the examples that hold such rules; with the example's rules the same file loads."""
    import taktiny as tt
    from examples import bert
    from taktiny.io import load_safetensors, save_safetensors

    config, theirs = hf_bert()
    path = tmp_path / "model.safetensors"
    save_safetensors(path, {k: numpy(v) for k, v in theirs.state_dict().items()})
    abstract = jax.eval_shape(lambda: bert.Bert(config, rngs=nn.Rngs(0)))
    given = len(theirs.state_dict())
    advice = (
        rf"\nNone of the {given} names given are the model's: they name its parameters "
        r"another way, as PyTorch and Hugging Face checkpoints do\. Convert them with rules "
        r"\(taktiny\.convert; docs/converting\.md\): load_safetensors\(model, path, "
        r"rules=rules\), or convert\.convert\(rules, state, target=model\) to load the "
        r"result\. convert\.pytorch\(model\) makes the rules for a model that mirrors a torch "
        r"module, from the layer presets \(convert\.linear, convert\.embedding, "
        r"convert\.layer_norm, \.\.\.\); examples/bert\.py, gpt2\.py and llama\.py hold the "
        r"RULES of Hugging Face's BERT, GPT-2 and Llama \(vit\.py and resnet\.py: ViT and "
        r"ResNet\)\.$"
    )
    problems = given + len(tt.flat_state_dict(abstract))  # every name unknown, every leaf missing
    head = (
        rf"(?s)^taktiny\.io\.load_safetensors\(Encoder\): {problems} problems; nothing was loaded"
    )
    with pytest.raises(tt.StateDictError, match=head + ".*" + advice):
        load_safetensors(abstract, path, progress=False)
    flat = {k: numpy(v) for k, v in theirs.state_dict().items()}
    with pytest.raises(
        tt.StateDictError, match=r"(?s)^Encoder\.load_flat_state_dict\(\): .*" + advice
    ):
        abstract.load_flat_state_dict(flat, strict=True)
    loaded = load_safetensors(abstract, path, rules=bert.RULES, progress=False)
    np.testing.assert_array_equal(loaded.word.embedding, flat["embeddings.word_embeddings.weight"])
