"""Optimizer state follows the model: the parameters' rules convert an optax state's
moments, checked against the same optimizer run from scratch on the converted model; a
partial load of both (`convert.resume`); and PyTorch's AdamW resumed in optax, step for
step against torch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import taktiny as tt
from taktiny import convert, nn

STEPS = 3


class Stacked(nn.Module):
    def __init__(self, key):
        self.kernel = jax.random.normal(key, (2, 4, 4)) / 2


class Target(nn.Module):
    """Every kind of rule: a rename (embed), a transpose (dense), a split (query, key), a
    concatenation (up) and a stack (stacked)."""

    def __init__(self, *, rngs, out=6):
        self.embed = nn.Embed(5, 4, rngs=rngs)
        self.query = nn.Linear(4, 4, use_bias=False, rngs=rngs)
        self.key = nn.Linear(4, 4, use_bias=False, rngs=rngs)
        self.up = nn.Linear(4, 6, use_bias=False, rngs=rngs)
        self.stacked = Stacked(rngs())
        self.dense = nn.Linear(6, out, rngs=rngs)

    def __call__(self, ids):
        h = self.embed(ids)
        h = jnp.tanh(self.query(h)) * self.key(h)
        for kernel in self.stacked.kernel:
            h = jnp.tanh(h @ kernel)
        return self.dense(jnp.tanh(self.up(h)))


RULES = [
    convert.Rule("emb.w", "embed.embedding"),
    convert.Rule("qk.weight", ["query.kernel", "key.kernel"], convert.split(-1)),
    convert.Rule(["up_a.w", "up_b.w"], "up.kernel", convert.concatenate(-1)),
    convert.Rule("layers.{i}.w", "stacked.kernel", convert.stack(0)),
    *convert.linear("fc", "dense"),
]


def to_target(source):
    """The source's parameters in the target's names, written out by hand (the oracle)."""
    return {
        "embed.embedding": source["emb"]["w"],
        "query.kernel": source["qk"]["weight"][:, :4],
        "key.kernel": source["qk"]["weight"][:, 4:],
        "up.kernel": jnp.concatenate([source["up_a"]["w"], source["up_b"]["w"]], -1),
        "stacked.kernel": jnp.stack([layer["w"] for layer in source["layers"]]),
        "dense.kernel": source["fc"]["weight"].T,
        "dense.bias": source["fc"]["bias"],
    }


def to_source(model):
    return {
        "emb": {"w": model.embed.embedding},
        "qk": {"weight": jnp.concatenate([model.query.kernel, model.key.kernel], -1)},
        "up_a": {"w": model.up.kernel[:, :3]},
        "up_b": {"w": model.up.kernel[:, 3:]},
        "layers": [{"w": k} for k in model.stacked.kernel],
        "fc": {"weight": model.dense.kernel.T, "bias": model.dense.bias},
    }


IDS = np.array([0, 1, 2, 3, 4, 1, 2])
Y = np.linspace(-1, 1, 7 * 6, dtype=np.float32).reshape(7, 6)


def target_loss(model):
    return jnp.mean((model(jnp.asarray(IDS)) - Y) ** 2)


def source_loss(model):
    return lambda source: target_loss(model.load_flat_state_dict(to_target(source)))


def run(optimizer, loss, params, steps=STEPS, state=None):
    state = optimizer.init(params) if state is None else state
    for _ in range(steps):
        grads = jax.grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def by_rank(params):
    return jax.tree.map(lambda x: "matrices" if x.ndim >= 2 else "vectors", params)


OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "chain": lambda: optax.chain(optax.clip(0.05), optax.adam(1e-2)),
    "multi_transform": lambda: optax.multi_transform(
        {"matrices": optax.adam(1e-2), "vectors": optax.sgd(1e-2, momentum=0.9)}, by_rank
    ),
    "multi_transform_frozen": lambda: optax.multi_transform(
        {"matrices": optax.adam(1e-2), "vectors": optax.set_to_zero()}, by_rank
    ),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
}


def assert_trees_close(got, want):
    names = tt.flat_state_dict(want)
    assert list(tt.flat_state_dict(got)) == list(names)
    for name, value in tt.flat_state_dict(got).items():
        np.testing.assert_allclose(value, names[name], rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_moments_follow_the_rules_as_if_run_from_scratch(name, optax_promotion):
    optimizer, start = OPTIMIZERS[name](), Target(rngs=nn.Rngs(0))
    # trained under the source's names and layouts ...
    params, state = run(optimizer, source_loss(start), to_source(start))
    # ... and converted, model and optimizer state, by the same rules
    model = start.load_flat_state_dict(
        convert.convert(RULES, tt.flat_state_dict(params), target=start), strict=True
    )
    abstract = jax.eval_shape(optimizer.init, start)  # shapes are enough
    flat = convert.convert(RULES, tt.flat_state_dict(state), target=abstract)
    assert list(flat) == list(tt.flat_state_dict(abstract))
    converted = tt.load_flat_state_dict(optimizer.init(start), flat, strict=True)
    # the oracle: the same optimizer, from scratch, on the target's names
    want_model, want_state = run(optimizer, target_loss, start)
    assert_trees_close(converted, want_state)
    assert_trees_close(model, want_model)
    # and the next step agrees
    assert_trees_close(
        run(optimizer, target_loss, model, 1, converted)[0],
        run(optimizer, target_loss, want_model, 1, want_state)[0],
    )
    moments = [n for n in flat if n.endswith("stacked.kernel")]
    assert moments, "the optimizer keeps moments for the stacked kernel"
    assert not np.array_equal(flat[moments[0]], np.zeros((2, 4, 4)))  # nontrivial moments


@pytest.fixture
def adam_state(optax_promotion):
    optimizer, start = optax.adam(1e-2), Target(rngs=nn.Rngs(0))
    _, state = run(optimizer, source_loss(start), to_source(start))
    return optimizer, start, tt.flat_state_dict(state)


def test_a_missing_or_unused_moment_is_named_in_full(adam_state):
    optimizer, start, source = adam_state
    del source["0.nu.fc.weight"]
    source["0.mu.extra.weight"] = source["0.mu.fc.bias"]
    with pytest.raises(convert.ConversionError, match="2 problems") as error:
        convert.convert(RULES, source, target=optimizer.init(start))
    assert [(p.kind, p.name) for p in error.value.problems] == [
        ("unused", "0.mu.extra.weight"),
        ("missing", "0.nu.dense.kernel"),
    ]
    assert "moment of the parameter 'dense.kernel'" in error.value.problems[1].hint


def test_allow_patterns_match_the_parameter_name_of_a_moment(adam_state):
    optimizer, start, source = adam_state
    del source["0.mu.fc.weight"], source["0.nu.fc.weight"]
    with pytest.raises(convert.ConversionError, match=r"'0.mu.dense.kernel'"):
        convert.convert(RULES, source, target=optimizer.init(start))
    report = convert.check(
        RULES, source, target=optimizer.init(start), allow={"missing": ["dense.kernel"]}
    )
    assert [p.name for p in report.allowed] == ["0.mu.dense.kernel", "0.nu.dense.kernel"]


def test_a_step_count_passes_through_and_must_be_in_the_source(adam_state):
    optimizer, start, source = adam_state
    target = optimizer.init(start)
    flat = convert.convert(RULES, source, target=target)
    assert int(flat["0.count"]) == STEPS
    del source["0.count"]
    with pytest.raises(convert.ConversionError, match=r"'0.count': this leaf .* no moment"):
        convert.convert(RULES, source, target=target)
    source["0.count"] = np.zeros(2, np.int32)
    with pytest.raises(convert.ConversionError, match=r"'0.count'.*int32\[2\]"):
        convert.convert(RULES, source, target=target)


def test_a_name_of_another_optimizer_is_unused(adam_state):
    _, start, source = adam_state
    sgd = optax.sgd(1e-2, momentum=0.9).init(start)
    with pytest.raises(convert.ConversionError, match=r"'0.count'.*same optimizer"):
        convert.convert(RULES, source, target=sgd)
    moments = {"0.trace." + n[5:]: v for n, v in source.items() if n.startswith("0.mu.")}
    report = convert.check(
        RULES, {**moments, "0.count": source["0.count"]}, target=sgd, allow={"unused": ["0.count"]}
    )
    assert [(p.kind, p.name) for p in report.allowed] == [("unused", "0.count")]


def test_a_model_target_converts_as_before(adam_state):
    _, start, _ = adam_state
    # a model is told apart from an optimizer state: a Rule that matches nothing is
    # still a problem there
    source = tt.flat_state_dict(to_source(start))
    with pytest.raises(
        convert.ConversionError,
        match=r"  - 'nothing.w': Rule\('nothing.w' -> .* matched no source name",
    ):
        convert.convert([*RULES, convert.Rule("nothing.w", "dense.bias")], source, target=start)


def test_labels_that_look_like_wildcards_are_refused(optax_promotion):
    start = Target(rngs=nn.Rngs(0))
    optimizer = optax.multi_transform(
        {"a*": optax.adam(1e-2), "b": optax.adam(1e-2)},
        lambda p: jax.tree.map(lambda x: "a*" if x.ndim >= 2 else "b", p),
    )
    with pytest.raises(ValueError, match=r"inner_states.a\*.inner_state.0.mu.*rename the labels"):
        convert.convert(RULES, {}, target=optimizer.init(start))


def test_regex_rules_and_ignores_apply_to_moments(adam_state):
    optimizer, start, source = adam_state
    rules = [
        convert.Ignore("skip.*"),
        convert.Rule(r"em[b]\.w", "embed.embedding", regex=True),
        *RULES[1:],
    ]
    source["0.mu.skip.me"] = source["0.nu.skip.me"] = np.zeros(3, np.float32)
    report = convert.check(rules, source, target=optimizer.init(start))
    assert report.ignored == ("0.mu.skip.me", "0.nu.skip.me")
    flat = convert.convert(rules, source, target=optimizer.init(start))
    np.testing.assert_array_equal(flat["0.nu.embed.embedding"], source["0.nu.emb.w"])


# --- resume: model and optimizer state together, with a new head ---------------------------


def test_resume_keeps_the_moments_it_loads_and_reinitialises_a_new_heads(adam_state):
    optimizer, start, source = adam_state
    params, _ = run(optimizer, source_loss(start), to_source(start))
    fresh = Target(rngs=nn.Rngs(3), out=2)  # a new head: dense has 2 outputs
    rules = [*RULES[:-2], convert.Ignore("fc.*")]
    model, state = convert.resume(
        rules,
        tt.flat_state_dict(params),
        source,
        model=fresh,
        opt_state=optimizer.init(fresh),
        allow={"missing": ["dense.*"]},
    )
    want_model, want_state = run(optimizer, target_loss, start)
    np.testing.assert_array_equal(model.dense.kernel, fresh.dense.kernel)  # kept
    np.testing.assert_allclose(model.up.kernel, want_model.up.kernel, rtol=1e-6)  # loaded
    for moment in ("mu", "nu"):
        kept = tt.flat_state_dict(getattr(state[0], moment))
        want = tt.flat_state_dict(getattr(want_state[0], moment))
        for name, value in kept.items():
            if name.startswith("dense."):
                np.testing.assert_array_equal(value, np.zeros_like(value), err_msg=name)
            else:
                np.testing.assert_allclose(value, want[name], rtol=1e-6, err_msg=name)
    assert int(state[0].count) == STEPS


def test_resume_refuses_a_loaded_parameter_without_its_moments(adam_state):
    optimizer, start, source = adam_state
    params = tt.flat_state_dict(to_source(start))
    del source["0.nu.emb.w"]
    del params["qk.weight"]
    with pytest.raises(convert.ConversionError, match=r"convert.resume: 4 problems") as error:
        convert.resume(
            RULES,
            params,
            source,
            model=start,
            opt_state=optimizer.init(start),
            allow={"missing": ["embed.*"]},  # allows the parameter, not its moments
        )
    assert [(p.kind, p.name) for p in error.value.problems] == [
        ("unmatched", "qk.weight"),
        ("missing", "query.kernel"),
        ("missing", "key.kernel"),
        ("missing", "0.nu.embed.embedding"),
    ]
    assert "the parameter is loaded, so its moments must be too" in str(error.value)


def test_resume_leaves_the_moments_of_a_parameter_it_does_not_load(adam_state):
    optimizer, start, source = adam_state
    params = tt.flat_state_dict(to_source(start))
    del params["up_a.w"], params["up_b.w"]  # the optimizer source still holds their moments
    fresh = optimizer.init(start)
    allow = {"missing": ["up.*"], "unmatched": ["up_a.w, up_b.w"]}  # (the rule's sources)
    _, state = convert.resume(RULES, params, source, model=start, opt_state=fresh, allow=allow)
    np.testing.assert_array_equal(state[0].mu.up.kernel, fresh[0].mu.up.kernel)
    np.testing.assert_array_equal(state[0].mu.embed.embedding, source["0.mu.emb.w"])


# --- PyTorch's AdamW, resumed in optax -------------------------------------------------------


def torch_run(steps=4, **options):
    torch.manual_seed(0)
    theirs = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    options = {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1, **options}
    optimizer = torch.optim.AdamW(theirs.parameters(), **options)
    x, y = torch.randn(16, 4), torch.randn(16, 3)

    def step():
        optimizer.zero_grad()
        torch.mean((theirs(x) - y) ** 2).backward()
        optimizer.step()

    for _ in range(steps):
        step()
    return theirs, optimizer, step, (x.numpy(), y.numpy())


def test_torch_adamw_resumes_in_optax_step_for_step(optax_promotion):
    theirs, optimizer, step, (x, y) = torch_run()
    ours = nn.Sequential(
        nn.Linear(4, 8, rngs=nn.Rngs(0)), jnp.tanh, nn.Linear(8, 3, rngs=nn.Rngs(1))
    )
    rules = convert.pytorch(ours)
    names = [n for n, _ in theirs.named_parameters()]
    source, hyperparameters = convert.torch_adam(optimizer.state_dict(), names)
    assert hyperparameters == {
        "learning_rate": 1e-2, "b1": 0.8, "b2": 0.95, "eps": 1e-6, "weight_decay": 0.1,
    }  # fmt: skip
    adamw = optax.adamw(**hyperparameters)
    model, state = convert.resume(
        rules, theirs.state_dict(), source, model=ours, opt_state=adamw.init(ours)
    )
    assert int(state[0].count) == 4
    np.testing.assert_array_equal(  # a Linear's moments are transposed as its weight is
        state[0].nu.layers[0].kernel, optimizer.state[theirs[0].weight]["exp_avg_sq"].numpy().T
    )
    loss = lambda m: jnp.mean((m(jnp.asarray(x)) - jnp.asarray(y)) ** 2)
    for _ in range(2):
        model, state = run(adamw, loss, model, 1, state)
        step()
        for name, value in convert.export(rules, model).items():
            np.testing.assert_allclose(
                value, theirs.state_dict()[name].numpy(), rtol=0, atol=1e-6, err_msg=name
            )
    assert not np.allclose(  # the decay and moments mattered: a fresh optax state differs
        run(adamw, loss, ours.load_flat_state_dict(convert.convert(rules, theirs.state_dict(),
            target=ours)), 1)[0].layers[0].kernel,
        model.layers[0].kernel,
        atol=1e-6,
    )  # fmt: skip


def test_torch_adam_refuses_what_it_cannot_resume():
    theirs, optimizer, _, _ = torch_run(steps=1)
    names = [n for n, _ in theirs.named_parameters()]
    state = optimizer.state_dict()
    with pytest.raises(ValueError, match=r"groups hold 4 parameters .* but 3 names"):
        convert.torch_adam(state, names[:3])
    broken = {**state, "state": {**state["state"], 1: {"step": torch.tensor(1.0)}}}
    with pytest.raises(ValueError, match=r"parameter 1 \('0.bias'\) lacks \['exp_avg', 'exp_av"):
        convert.torch_adam(broken, names)
    broken = {**state, "state": {k: v for k, v in state["state"].items() if k != 2}}
    with pytest.raises(ValueError, match=r"parameter 2 \('2.weight'\) has no state"):
        convert.torch_adam(broken, names)
    later = {**state["state"][3], "step": torch.tensor(2.0)}
    with pytest.raises(ValueError, match=r"stepped different numbers of times .*'2.bias': 2"):
        convert.torch_adam({**state, "state": {**state["state"], 3: later}}, names)
    group = state["param_groups"][0]
    groups = [{**group, "params": [0, 1]}, {**group, "params": [2, 3], "lr": 0.1}]
    with pytest.raises(ValueError, match=r"groups 0 and 1 differ in \['lr'\].*multi_transform"):
        convert.torch_adam({**state, "param_groups": groups}, names)
    with pytest.raises(ValueError, match=r"amsgrad=True is not supported"):
        convert.torch_adam({**state, "param_groups": [{**group, "amsgrad": True}]}, names)
    coupled = {**group, "decoupled_weight_decay": False}
    with pytest.raises(ValueError, match=r"torch.optim.Adam with weight_decay=0.1.*L2"):
        convert.torch_adam({**state, "param_groups": [coupled]}, names)
    with pytest.raises(ValueError, match=r"takes optimizer.state_dict\(\).*keys \['state'\]"):
        convert.torch_adam({"state": {}}, names)


def test_torch_adam_converts_one_group_at_a_time():
    theirs, optimizer, _, _ = torch_run(steps=2)
    state = optimizer.state_dict()
    group = {**state["param_groups"][0], "params": [2, 3]}
    source, _ = convert.torch_adam(
        {"state": state["state"], "param_groups": [group]},
        ["2.weight", "2.bias"],
        prefix="inner_states.head.inner_state.0",
    )
    assert sorted(source) == [
        "inner_states.head.inner_state.0.count",
        "inner_states.head.inner_state.0.mu.2.bias",
        "inner_states.head.inner_state.0.mu.2.weight",
        "inner_states.head.inner_state.0.nu.2.bias",
        "inner_states.head.inner_state.0.nu.2.weight",
    ]
    exp_avg = optimizer.state[theirs[2].bias]["exp_avg"]
    assert source["inner_states.head.inner_state.0.mu.2.bias"] is exp_avg
