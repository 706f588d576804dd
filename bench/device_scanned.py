"""Where a scanned decoder's training step spends its time on an accelerator, against the
same model with a list of layers (issue 53 point 2; bench/FINDINGS.md section 17).

A ``taktiny.models.Decoder`` of the Llama family, 1024 wide and 32 layers deep (heads of
128, half as many key/value heads, an MLP 11/4 as wide, float32 parameters), one training
step of 4 x 256 tokens (next-token cross-entropy, ``jax.value_and_grad``, ``optax.adam``),
the model and optimizer state donated. Variants of the same weights:

- ``unrolled``: the list of layers;
- ``stack``: ``nn.Stack`` as a user gets it;
- ``stack_unroll2``: the stack's layers scanned two at a time (``jax.lax.scan(unroll=2)``);
- ``stack_remat_<policy>``: ``nn.Stack(remat=...)`` with ``dots_saveable``,
  ``dots_with_no_batch_dims_saveable`` or everything recomputed;
- ``loop_over_stacked``: the stacked weights sliced layer by layer in a Python loop (the
  slicing and the stacked gradients without the loop);
- ``stack_adam_in_backward``: the stack's layers scanned forward keeping each layer's
  input, then backward in a second scan that recomputes each layer, takes its gradient
  and applies Adam to that layer's slice of the weights and moments there, so that no
  stacked gradient is made and no Adam pass runs after the loop (FINDINGS 17: 12.7 ms of
  the stack's 17.5 ms more than the unrolled step). The same update as ``optax.adam``;
- ``stack_adam_in_backward_carried``: the same, the stacked weights and moments carried
  through the backward scan and each layer's slice written into them in place.

For each: the step's median time over 10 calls, its compile time, the compiled program's
temporary memory (``memory_analysis``) at 4 x 256 tokens and at 4 x 512, and a count of
some HLO instructions. ``--trace DIR`` also writes a ``jax.profiler`` trace of 3 steps of
``unrolled`` and ``stack`` (read with xprof's ``hlo_stats`` tool: FINDINGS 17).

    python bench/device_scanned.py > scanned.json          # on the accelerator's host
    python bench/device_scanned.py --smoke                  # a tiny model, any machine
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

import taktiny as tt
from taktiny import models, nn

COUNTED = ("copy", "transpose", "dynamic-slice", "dynamic-update-slice", "fusion", "while")


def config(smoke: bool) -> models.DecoderConfig:
    """The decoder's config: 1024 wide and 32 deep, or tiny with `smoke`."""
    width, layers = (64, 4) if smoke else (1024, 32)
    heads = max(4, width // 128)
    return models.DecoderConfig.from_hf(
        {
            "model_type": "llama",
            "vocab_size": 1024,
            "hidden_size": width,
            "intermediate_size": width * 11 // 4,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": heads // 2,
            "head_dim": width // heads,
            "max_position_embeddings": 4096,
        }
    )


def scanned_by_hand(unroll: int) -> Any:
    """A forward pass that scans the stack's layers `unroll` at a time."""

    def forward(model: Any, ids: jax.Array) -> jax.Array:
        body = lambda x, block: (block(x)[0], None)
        x, _ = jax.lax.scan(body, model.embed(ids), model.layers.block, unroll=unroll)
        return model.lm_head(model.norm(x))

    return forward


def sliced_in_a_loop(model: Any, ids: jax.Array) -> jax.Array:
    """A forward pass over the stack's layers in a Python loop, each sliced out."""
    leaves, structure = jax.tree.flatten(model.layers.block)
    x = model.embed(ids)
    for i in range(model.layers.count):
        x, _ = jax.tree.unflatten(structure, [leaf[i] for leaf in leaves])(x)
    return model.lm_head(model.norm(x))


LR, B1, B2, EPS = 1e-4, 0.9, 0.999, 1e-8  # (optax.adam(LR)'s)


def adam(params: Any, grads: Any, mu: Any, nu: Any, count: jax.Array) -> tuple[Any, Any, Any]:
    """One step of ``optax.adam(LR)`` on `params` (`count`: the steps before this one):
    the new parameters and moments."""
    t = (count + 1).astype(jnp.float32)
    mu = jax.tree.map(lambda m, g: B1 * m + (1 - B1) * g, mu, grads)
    nu = jax.tree.map(lambda v, g: B2 * v + (1 - B2) * g * g, nu, grads)
    step = lambda p, m, v: p - LR * (m / (1 - B1**t)) / (jnp.sqrt(v / (1 - B2**t)) + EPS)
    return jax.tree.map(step, params, mu, nu), mu, nu


def adam_in_backward(model: Any, state: Any, ids: jax.Array, in_place: bool = False) -> Any:
    """A training step of a scanned decoder whose backward scan updates each layer as its
    gradient is made (``stack_adam_in_backward``; with `in_place`, the stacked weights and
    moments carried through the scan and each layer's slice written into them,
    ``stack_adam_in_backward_carried``). `state` is ``(count, mu, nu)``, the moments
    shaped as the model; returns what `make_step`'s step returns."""
    count, mu, nu = state
    inputs, labels = ids[:, :-1], ids[:, 1:]
    rest, blocks = model.replace(layers=None), model.layers.block

    def loss_of(rest: Any, x: jax.Array) -> jax.Array:
        logits = rest.lm_head(rest.norm(x))
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    x, embed_vjp = jax.vjp(lambda rest: rest.embed(inputs), rest)
    x, kept = jax.lax.scan(lambda x, block: (block(x)[0], x), x, blocks)  # (each input)
    loss, loss_vjp = jax.vjp(loss_of, rest, x)
    head_grads, dx = loss_vjp(jnp.ones_like(loss))

    def layer(dx: jax.Array, block: Any, x: jax.Array, m: Any, v: Any) -> Any:
        _, vjp = jax.vjp(lambda block, x: block(x)[0], block, x)
        grads, dx = vjp(dx)
        return dx, adam(block, grads, m, v, count)

    stacks = (blocks, mu.layers.block, nu.layers.block)
    if in_place:

        def carried(carry: Any, i: jax.Array) -> tuple[Any, None]:
            dx, stacks = carry
            block, m, v = jax.tree.map(lambda a: a[i], stacks)
            dx, new = layer(dx, block, kept[i], m, v)
            return (dx, jax.tree.map(lambda a, n: a.at[i].set(n), stacks, new)), None

        order = jnp.arange(model.layers.count)
        (dx, stacks), _ = jax.lax.scan(carried, (dx, stacks), order, reverse=True)
    else:
        back = lambda dx, xs: layer(dx, *xs)
        dx, stacks = jax.lax.scan(back, dx, (stacks[0], kept, *stacks[1:]), reverse=True)
    (embed_grads,) = embed_vjp(dx)
    grads = jax.tree.map(jnp.add, head_grads, embed_grads)
    rest_mu, rest_nu = mu.replace(layers=None), nu.replace(layers=None)
    rest, rest_mu, rest_nu = adam(rest, grads, rest_mu, rest_nu, count)
    with_layers = lambda tree, block: tree.replace(layers=model.layers.replace(block=block))
    mu, nu = with_layers(rest_mu, stacks[1]), with_layers(rest_nu, stacks[2])
    return with_layers(rest, stacks[0]), (count + 1, mu, nu), loss


def adam_in_backward_carried(model: Any, state: Any, ids: jax.Array) -> Any:
    """`adam_in_backward` with the stacks carried and written in place."""
    return adam_in_backward(model, state, ids, in_place=True)


def step_and_state(forward: Any, model: Any) -> tuple[Any, Any]:
    """The training step of a variant's `forward` and its optimizer state for `model`."""
    if forward in (adam_in_backward, adam_in_backward_carried):
        zeros = jax.tree.map(jnp.zeros_like, model)
        return forward, (jnp.zeros((), jnp.int32), zeros, zeros)
    optimizer = optax.adam(LR)
    return make_step(forward, optimizer), optimizer.init(model)


def make_step(forward: Any, optimizer: Any) -> Any:
    """A training step: the loss of `forward`, its gradients, an Adam update."""

    def step(model: Any, state: Any, ids: jax.Array) -> Any:
        def loss(model: Any) -> jax.Array:
            logits = forward(model, ids[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

        value, grads = jax.value_and_grad(loss)(model)
        updates, state = optimizer.update(grads, state, model)
        return optax.apply_updates(model, updates), state, value

    return step


def variants(smoke: bool) -> dict[str, tuple[Any, Any]]:
    """Name -> (model, forward) for each variant, all holding the same weights."""
    cfg = config(smoke)
    unrolled = models.Decoder(cfg, rngs=nn.Rngs(0))
    abstract = jax.eval_shape(lambda: models.Decoder(cfg, scanned=True, rngs=nn.Rngs(0)))
    stack = tt.load_flat_state_dict(abstract, unrolled.flat_state_dict(), strict=True)
    remat = lambda policy: stack.replace(layers=stack.layers.replace(remat=policy))
    plain = lambda model, ids: model(ids)
    policies = jax.checkpoint_policies
    return {
        "unrolled": (unrolled, plain),
        "stack": (stack, plain),
        "stack_unroll2": (stack, scanned_by_hand(2)),
        "stack_remat_dots": (remat(policies.dots_saveable), plain),
        "stack_remat_nobatch": (remat(policies.dots_with_no_batch_dims_saveable), plain),
        "stack_remat_all": (remat(True), plain),
        "loop_over_stacked": (stack, sliced_in_a_loop),
        "stack_adam_in_backward": (stack, adam_in_backward),
        "stack_adam_in_backward_carried": (stack, adam_in_backward_carried),
    }


def measure(model: Any, forward: Any, ids: jax.Array, repeats: int) -> dict[str, Any]:
    """One variant's step: compile time, temporary memory, HLO counts, median step time."""
    step, state = step_and_state(forward, model)
    start = time.perf_counter()
    step = jax.jit(step, donate_argnums=(0, 1))
    compiled = step.lower(model, state, ids).compile()
    compile_s = time.perf_counter() - start
    memory, text = compiled.memory_analysis(), compiled.as_text()
    model, state = jax.tree.map(jnp.copy, (model, state))  # donated below
    model, state, loss = compiled(model, state, ids)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model, state, loss = compiled(model, state, ids)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - start)
    temp = None if memory is None else memory.temp_size_in_bytes / 2**20
    return {
        "step_ms": statistics.median(times) * 1e3,
        "compile_s": compile_s,
        "temp_MiB": temp,
        "loss": float(loss),
        **{name: text.count(f"{name}(") for name in COUNTED},
    }


def trace(found: dict[str, tuple[Any, Any]], ids: jax.Array, folder: str) -> None:
    """A profiler trace of 3 steps of `unrolled` and of `stack`, each in its own folder."""
    for name in ("unrolled", "stack"):
        model, forward = found[name]
        step, state = step_and_state(forward, model)
        step = jax.jit(step, donate_argnums=(0, 1))
        model, state = jax.tree.map(jnp.copy, (model, state))
        model, state, loss = step(model, state, ids)
        jax.block_until_ready(loss)
        with jax.profiler.trace(f"{folder}/{name}"):
            for _ in range(3):
                model, state, loss = step(model, state, ids)
            jax.block_until_ready(loss)


def main(argv: list[str]) -> dict[str, Any]:
    smoke = "--smoke" in argv
    batch, tokens = (2, 16) if smoke else (4, 256)
    ids = jax.random.randint(jax.random.key(1), (batch, tokens + 1), 0, 1024)
    longer = jax.random.randint(jax.random.key(1), (batch, 2 * tokens + 1), 0, 1024)
    found = variants(smoke)
    out: dict[str, Any] = {"device": str(jax.devices()[0].device_kind)}
    for name, (model, forward) in found.items():
        try:
            out[name] = measure(model, forward, ids, 3 if smoke else 10)
            step, state = step_and_state(forward, model)
            memory = jax.jit(step).lower(model, state, longer).compile()
            analysis = memory.memory_analysis()
            if analysis is not None:
                out[name]["temp_MiB_twice_the_tokens"] = analysis.temp_size_in_bytes / 2**20
        except Exception as error:  # noqa: BLE001 -- one variant out of memory: say so, go on
            out[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        print(name, out[name], file=sys.stderr, flush=True)
    unrolled = out["unrolled"].get("step_ms")
    for figures in out.values():
        if isinstance(figures, dict) and "step_ms" in figures and unrolled:
            figures["x_unrolled"] = figures["step_ms"] / unrolled
    if "--trace" in argv:
        trace(found, ids, argv[argv.index("--trace") + 1])
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=1))
