"""jit dispatch: the same step taking each system's model, timed per call.

A trivial step (``x + 1``; the model is an argument only, so the time is the cost
of getting the model in and out of the compiled call) on the 384- and 3,000-leaf
models, and a real training step (forward, backward, Adam update) of an MLP and a
small transformer. Systems: Taktiny via plain ``jax.jit``; the same step on the
model's nested dict of arrays via ``jax.jit``; Equinox via ``eqx.filter_jit``;
NNX via ``nnx.jit``, and via ``nnx.split`` once + ``jax.jit`` on the state.
"""

from __future__ import annotations

import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from . import _models, _nets
from ._results import Config, Group, Table, Target, faster
from ._timing import compare

SYSTEMS = ["Taktiny", "nested dict", "Equinox", "NNX nnx.jit", "NNX split + jax.jit"]
CALLS = {
    "Taktiny": "jax.jit(step)(model, ...)",
    "nested dict": "jax.jit(step)(model.state_dict(), ...)",
    "Equinox": "eqx.filter_jit(step)(model, ...)",
    "NNX nnx.jit": "nnx.jit(step)(model, ...)",
    "NNX split + jax.jit": "jax.jit(step)(state, ...), graphdef, state = nnx.split(model) once",
}


def _trivial(n: int) -> dict[str, Any]:
    """system -> a zero-argument call of the trivial step on the `n`-block model."""
    x = jnp.ones((4,))
    step = lambda model, x: x + 1.0
    tt = _models.build("taktiny", n, 0)
    nx = _models.build("nnx", n, 0)
    graphdef, nx_state = nnx.split(nx)
    nx_step = jax.jit(lambda state, x: step(nnx.merge(graphdef, state), x))
    calls = {
        "Taktiny": (jax.jit(step), tt),
        "nested dict": (jax.jit(step), tt.state_dict()),
        "Equinox": (eqx.filter_jit(step), _models.build("equinox", n, 0)),
        "NNX nnx.jit": (nnx.jit(step), nx),
        "NNX split + jax.jit": (nx_step, nx_state),
    }
    return {s: (lambda f=f, m=m: f(m, x).block_until_ready()) for s, (f, m) in calls.items()}


def _looping(step: Any, model: Any, opt_state: Any, batch: Any) -> Any:
    """A zero-argument training step that carries the model and optimizer state along."""
    box = [model, opt_state]

    def call() -> None:
        box[0], box[1], loss = step(box[0], box[1], batch)
        loss.block_until_ready()

    return call


def _training(net: str, sizes: dict[str, Any], batch: Any) -> dict[str, Any]:
    """system -> a zero-argument training step of `net` (state carried from call to call)."""
    tx = optax.adam(1e-3)
    loss = lambda model, batch: _nets.loss(net, model, batch)

    def step(model: Any, opt_state: Any, batch: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(model, batch)
        updates, opt_state = tx.update(grads, opt_state, model)
        return optax.apply_updates(model, updates), opt_state, value

    tt = _nets.build("taktiny", net, sizes)
    abstract = jax.eval_shape(lambda: tt)
    dict_loss = lambda params, batch: loss(abstract.load_state_dict(params, strict=True), batch)

    def dict_step(params: Any, opt_state: Any, batch: Any) -> Any:
        value, grads = jax.value_and_grad(dict_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    eq = _nets.build("equinox", net, sizes)

    @eqx.filter_jit
    def eqx_step(model: Any, opt_state: Any, batch: Any) -> Any:
        value, grads = eqx.filter_value_and_grad(loss)(model, batch)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    nx = _nets.build("nnx", net, sizes)
    nx_opt = nnx.Optimizer(nx, tx, wrt=nnx.Param)

    @nnx.jit
    def nnx_step(model: Any, optimizer: Any, batch: Any) -> Any:
        value, grads = nnx.value_and_grad(loss)(model, batch)
        optimizer.update(model, grads)  # NNX updates the model and optimizer in place
        return value

    graphdef, nx_state = nnx.split(_nets.build("nnx", net, sizes))

    split_loss = lambda state, batch: loss(nnx.merge(graphdef, state), batch)

    @jax.jit
    def split_step(state: Any, opt_state: Any, batch: Any) -> Any:
        value, grads = jax.value_and_grad(split_loss)(state, batch)
        updates, opt_state = tx.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, value

    params = tt.state_dict()
    return {
        "Taktiny": _looping(jax.jit(step), tt, tx.init(tt), batch),
        "nested dict": _looping(jax.jit(dict_step), params, tx.init(params), batch),
        "Equinox": _looping(eqx_step, eq, tx.init(eqx.filter(eq, eqx.is_array)), batch),
        "NNX nnx.jit": lambda: nnx_step(nx, nx_opt, batch).block_until_ready(),
        "NNX split + jax.jit": _looping(split_step, nx_state, tx.init(nx_state), batch),
    }


def _sizes(config: Config) -> dict[str, Any]:
    return {
        "mlp": config.pick([64, 256, 256, 256, 10], [64, 256, 256, 10], [4, 8, 2]),
        "transformer": config.pick(
            {"vocab": 256, "seq": 32, "d": 64, "hidden": 256, "depth": 2},
            {"vocab": 256, "seq": 32, "d": 64, "hidden": 256, "depth": 2},
            {"vocab": 16, "seq": 4, "d": 8, "hidden": 16, "depth": 1},
        ),
        "batch": config.pick(64, 64, 2),
        "tokens_batch": config.pick(8, 8, 2),
    }


def _batches(sizes: dict[str, Any]) -> dict[str, Any]:
    key, n = jax.random.key(0), sizes["batch"]
    mlp, tf = sizes["mlp"], sizes["transformer"]
    x = jax.random.normal(key, (n, mlp[0]))
    tokens = jax.random.randint(key, (sizes["tokens_batch"], tf["seq"]), 0, tf["vocab"])
    return {"mlp": (x, jnp.tanh(x[:, : mlp[-1]])), "transformer": (tokens, tokens)}


def run(config: Config) -> Group:
    """Times each system's step per call, interleaved, and checks the dispatch targets."""
    start = time.perf_counter()
    group = Group("dispatch", "jit dispatch")
    trivial = Table("Trivial jitted step (x + 1), model as an argument", SYSTEMS)
    for n in config.pick([64, 500], [64], [2]):
        op = f"{n * _models.LEAVES_PER_BLOCK:,}-leaf model"
        stats = compare(_trivial(n), repeat=config.repeat, warmup=3)
        for system, st in stats.items():
            trivial.add(op, system, CALLS[system], st.median, (st.low, st.high))
        group.targets += [
            Target(  # issue 22: at most 0.85x (it was 1.0x)
                f"jax.jit dispatch of a Taktiny model <= 0.85x the nested dict ({op})",
                1 / faster(trivial, op, "nested dict"),
                0.85,
                False,
                "Taktiny time / nested-dict time",
            ),
            Target(
                f"jax.jit dispatch of a Taktiny model >= 20x faster than nnx.jit ({op})",
                faster(trivial, op, "NNX nnx.jit"),
                20.0,
                True,
                "nnx.jit time / Taktiny time",
            ),
        ]
    group.tables.append(trivial)

    sizes = _sizes(config)
    batches = _batches(sizes)
    training = Table("Training step (forward, backward, Adam update)", SYSTEMS)
    # --quick leaves out the transformer: its five XLA compiles alone take ~20 s here
    nets = config.pick(["mlp", "transformer"], ["mlp"], ["mlp", "transformer"])
    for net in nets:
        title = {"mlp": "MLP", "transformer": "small transformer"}[net]
        stats = compare(_training(net, sizes, batches[net]), repeat=config.repeat, warmup=2)
        for system, st in stats.items():
            training.add(title, system, CALLS[system], st.median, (st.low, st.high))
    group.tables.append(training)
    mlp, tf = sizes["mlp"], sizes["transformer"]
    group.notes += [
        "Each call blocks until its result is ready. Training steps carry their model and "
        "optimizer state from call to call, as a training loop does; NNX's nnx.jit step updates "
        "its model and nnx.Optimizer in place.",
        f"MLP: layer sizes {mlp}, batch {sizes['batch']}, MSE loss. Transformer: "
        f"{tf['depth']} pre-norm blocks, width {tf['d']}, {_nets.HEADS} heads, MLP {tf['hidden']},"
        f" vocab {tf['vocab']}, sequence {tf['seq']}, batch {sizes['tokens_batch']}, "
        "next-token loss; "
        "built from nn.Linear plus plain JAX layer norm, attention and embedding lookup.",
        "The nested-dict step loads its dict into an abstract Taktiny model inside the trace, "
        "so the compiled computation is the same as Taktiny's; only the argument differs.",
    ]
    group.seconds = time.perf_counter() - start
    return group
