"""Scanned layers: the Llama of ``examples/llama.py`` with its decoder layers held as one
``nn.Stack`` (run by ``jax.lax.scan``) against the same model with a Python list of layers.

- Compile time of a training step: the next-token cross-entropy of the logits,
  ``jax.value_and_grad`` and an ``optax.adam`` update, ``jax.jit(step).lower(model,
  opt_state, ids).compile()`` timed (tracing and lowering, then XLA's compile), a fresh
  step function each time and ``jax.clear_caches()`` before it, so nothing is cached.
  Scanned and unrolled alternate within each round; the ratio is the median of per-round
  ratios. A 1-layer model is measured too: what a compile costs besides the layers.
- Step time of the compiled step, scanned against unrolled, interleaved rounds; both models
  hold the same weights (the unrolled model's per-layer state loaded into the stack), and
  their losses are checked equal first.
- Streaming a per-layer checkpoint (Hugging Face's names, ``model.layers.{i}...``, written
  by ``taktiny.io.save_safetensors`` of ``taktiny.convert.export(UNTIED_RULES, model)``) into
  the abstract stacked model, slice by slice, against loading it into the abstract unstacked
  model, both with the example's rules, from a warm page cache. Peak host memory of each
  load in a fresh subprocess (``bench.memory``'s worker), its growth over the process's
  memory just before the load, against the model's bytes.
- A partial load of one layer into the concrete stacked model: ``tt.load_flat_state_dict``
  of layer 3's per-layer names, and ``load_safetensors(strict=False)`` of a file holding
  layer 3 only, against the full per-layer load and against the floor, one copy of the
  stacked leaves the layer touches (JAX arrays are immutable: a new stacked leaf is made
  for every leaf a layer's slice is written into).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import taktiny as tt

from . import _disk, memory
from ._results import Config, Group, Table, Target
from ._timing import compare, paired_ratio
from .decoding import llama

SCANNED, UNROLLED = "scanned (nn.Stack)", "unrolled (list of layers)"
# the stack with each layer under jax.checkpoint, keeping the matrix products' results:
# the backward loop recomputes the cheap elementwise work instead of stacking it
REMAT = "scanned, remat=dots_saveable"
STACKED, UNSTACKED = "stacked model", "unstacked model"
COMPILE_RATIO, STEP_RATIO, LOAD_SHARE, GROWTH = 0.15, 1.05, 0.85, 1.05  # the targets
LAYER = 3  # the layer of the partial load
# mode -> (the training step's depths, its batch x tokens, the load's (width, layers))
SIZES = {
    # a training step of 4 x 128 tokens: at a few dozen tokens a step is mostly the
    # weights' traffic, and the scan's per-layer slicing of them shows (FINDINGS 12)
    "full": ((1, 16, 32), (4, 128), (1024, 22)),  # 22 layers of width 1024: 1.03 GB
    "quick": ((1, 16, 32), (2, 16), (512, 16)),
    "smoke": ((2,), (1, 4), (64, 4)),
}
VOCAB = 1024
# the example's rules for the decoder layers alone: a file of one layer loads with these
LAYER_RULES = [
    r for r in llama.UNTIED_RULES if getattr(r, "sources", ("",))[0].startswith("model.layers.{i}.")
]


def llama_config(width: int, layers: int) -> Any:
    """The example's untied Llama 3.1 config at another size: `width` wide (heads of 64 or
    128 features, half as many key/value heads, an MLP 11/4 as wide), `layers` deep."""
    heads = max(4, width // 128)
    fields = llama.llama_config(tied=False).to_dict()
    fields.update(
        vocab_size=VOCAB, hidden_size=width, intermediate_size=width * 11 // 4,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
        head_dim=width // heads,
    )  # fmt: skip
    return llama.LlamaConfig(**fields)


def abstract(width: int, layers: int, scanned: bool) -> Any:
    """The Llama as shapes only: what a load reads into."""
    config = llama_config(width, layers)
    return jax.eval_shape(lambda: llama.Llama(config, rngs=llama.nn.Rngs(0), scanned=scanned))


def _nbytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def make_step(optimizer: Any) -> Any:
    """A fresh training step function: loss, gradients, an Adam update."""

    def step(model: Any, opt_state: Any, ids: jax.Array) -> Any:
        def loss(model: Any) -> jax.Array:
            logits = model(ids[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

        value, grads = jax.value_and_grad(loss)(model)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return optax.apply_updates(model, updates), opt_state, value

    return step


def _compile(
    model: Any, opt_state: Any, ids: jax.Array, optimizer: Any
) -> tuple[Any, float, float]:
    """A fresh step compiled, nothing cached, and the seconds to trace and lower it and to
    compile it."""
    jax.clear_caches()
    start = time.perf_counter()
    lowered = jax.jit(make_step(optimizer)).lower(model, opt_state, ids)
    traced = time.perf_counter()
    compiled = lowered.compile()
    return compiled, traced - start, time.perf_counter() - traced


def _models(width: int, layers: int) -> dict[str, Any]:
    """The unrolled model, and the scanned one holding the same weights."""
    config = llama_config(width, layers)
    unrolled = llama.Llama(config, rngs=llama.nn.Rngs(0))
    flat = unrolled.flat_state_dict()  # per-layer names: they load into the stack's slices
    scanned = tt.load_flat_state_dict(abstract(width, layers, True), flat, strict=True)
    policy = jax.checkpoint_policies.dots_saveable
    remat = scanned.replace(layers=scanned.layers.replace(remat=policy))
    return {SCANNED: scanned, REMAT: remat, UNROLLED: unrolled}


def _training(config: Config, group: Group) -> None:
    """Compile time and step time of the training step, scanned against unrolled."""
    depths, (batch, length), _ = SIZES[config.mode]
    width = config.pick(256, 256, 64)
    optimizer = optax.adam(1e-3)
    ids = np.random.default_rng(0).integers(0, VOCAB, (batch, length + 1))
    ids = jnp.asarray(ids, jnp.int32)
    rounds = config.pick(3, 2, 1)
    compiles = Table(
        f"Compile time of a training step (trace + lower + XLA compile), width {width}",
        [SCANNED, REMAT, UNROLLED],
        reference=SCANNED,
    )
    steps = Table(
        f"Training step time (compiled), batch {batch} x {length} tokens, width {width}",
        [SCANNED, REMAT, UNROLLED],
        reference=SCANNED,
    )
    call = "jax.jit(step).lower(model, opt_state, ids).compile(), jax.clear_caches() first"
    parts: dict[int, dict[str, list[tuple[float, float]]]] = {}
    step_ratios: dict[tuple[int, str], float] = {}
    for depth in depths:
        models = _models(width, depth)
        states = {s: optimizer.init(m) for s, m in models.items()}
        times: dict[str, list[tuple[float, float]]] = {s: [] for s in models}
        compiled: dict[str, Any] = {}  # each one's last compiled step: the one timed below
        for r in range(rounds):  # alternate: which goes first changes each round
            for system in list(models)[:: 1 if r % 2 == 0 else -1]:
                compiled[system], *seconds = _compile(
                    models[system], states[system], ids, optimizer
                )
                times[system].append((seconds[0], seconds[1]))
        parts[depth] = times
        for system, ts in times.items():
            totals = [a + b for a, b in ts]
            compiles.add(f"{depth} layers", system, call, statistics.median(totals),
                         (min(totals), max(totals)))  # fmt: skip
        if depth == 1:
            continue  # the fixed cost of a compile, not a step to time
        losses = {s: float(fn(models[s], states[s], ids)[2]) for s, fn in compiled.items()}
        assert np.isclose(losses[SCANNED], losses[UNROLLED], rtol=1e-4), losses
        assert np.isclose(losses[REMAT], losses[UNROLLED], rtol=1e-4), losses
        stats = compare(
            {
                s: (lambda fn=fn, m=models[s], o=states[s]: jax.block_until_ready(fn(m, o, ids)))
                for s, fn in compiled.items()
            },
            repeat=config.repeat,
            warmup=2,
        )
        for system, st in stats.items():
            steps.add(f"{depth} layers", system, "compiled(model, opt_state, ids)", st.median,
                      (st.low, st.high))  # fmt: skip
        for system in (SCANNED, REMAT):
            step_ratios[depth, system] = paired_ratio(stats[system], stats[UNROLLED])

    def compile_ratio(depth: int, system: str = SCANNED) -> float:
        pairs = zip(parts[depth][system], parts[depth][UNROLLED], strict=True)
        return statistics.median((a + b) / (c + d) for (a, b), (c, d) in pairs)

    ratios = Table(
        "Scanned / unrolled", [SCANNED, REMAT], reference=SCANNED, unit="x", log=False, line=1.0
    )
    deep = [d for d in depths if d > 1]
    for depth in deep:
        for system in (SCANNED, REMAT):
            ratios.add(f"compile time, {depth} layers", system, "scanned / unrolled",
                       compile_ratio(depth, system))  # fmt: skip
            ratios.add(f"step time, {depth} layers", system, "scanned / unrolled",
                       step_ratios[depth, system])  # fmt: skip
    group.tables += [compiles, steps, ratios]
    top = deep[-1]
    paired = "median of per-round ratios"
    group.targets += [
        Target(
            f"compile time of a training step, scanned <= {COMPILE_RATIO:g}x unrolled at {top} "
            "layers",
            compile_ratio(top),
            COMPILE_RATIO,
            False,
            f"scanned (trace + lower + compile) / unrolled, {paired}",
        ),
        Target(
            f"training step time, scanned <= {STEP_RATIO:g}x unrolled at {top} layers",
            step_ratios[top, SCANNED],
            STEP_RATIO,
            False,
            f"scanned step time / unrolled step time, {paired}",
        ),
        Target(
            f"compile time, scanned with remat=dots_saveable <= {COMPILE_RATIO:g}x unrolled at "
            f"{top} layers",
            compile_ratio(top, REMAT),
            COMPILE_RATIO,
            False,
            f"scanned, remat=dots_saveable / unrolled, {paired}",
        ),
        Target(
            f"training step time, scanned with remat=dots_saveable <= {STEP_RATIO:g}x unrolled "
            f"at {top} layers",
            step_ratios[top, REMAT],
            STEP_RATIO,
            False,
            f"scanned, remat=dots_saveable / unrolled, {paired}",
        ),
    ]

    def split(depth: int, system: str) -> str:
        ts = parts[depth][system]
        lower = statistics.median(a for a, _ in ts)
        xla = statistics.median(b for _, b in ts)
        return f"{lower:.2f} + {xla:.2f} s"

    group.notes += [
        f"The model: examples/llama.py's Llama (untied head, Llama 3.1 rotary scaling), vocab "
        f"{VOCAB}, width {width}, MLP {width * 11 // 4}, {max(4, width // 128)} query heads "
        f"sharing {max(4, width // 128) // 2} key/value heads, float32; the loss the "
        "cross-entropy of the next-token logits; optax.adam(1e-3). Not donated: every call "
        "takes the same model and state.",
        f"Compile: {rounds} round(s), scanned and unrolled alternating; time split as trace + "
        "lower, then XLA's compile (medians): "
        + "; ".join(
            f"{d} layers {SCANNED} {split(d, SCANNED)}, {REMAT} {split(d, REMAT)}, "
            f"{UNROLLED} {split(d, UNROLLED)}"
            for d in depths
        )
        + ". The 1-layer row is the compile's fixed cost (embedding, head, cross-entropy, "
        "Adam, one layer): the scanned step compiles about that whatever the depth.",
    ]


def _load(path: Path, abstracts: dict[str, Any]) -> Any:
    import taktiny.io as tio

    return tio.load_safetensors(
        abstracts["taktiny"], path, rules=llama.UNTIED_RULES, progress=False
    )


NEEDS = {STACKED: ["taktiny.io"], UNSTACKED: ["taktiny.io"]}
CALL = "taktiny.io.load_safetensors(abstract, path, rules=UNTIED_RULES)"
RESTORE = {STACKED: (f"{CALL}, scanned", _load), UNSTACKED: (f"{CALL}, unrolled", _load)}
ABSTRACTS = {  # bench.memory's worker builds each case's target from (width, layers)
    STACKED: lambda width, layers: {"taktiny": abstract(width, layers, True)},
    UNSTACKED: lambda width, layers: {"taktiny": abstract(width, layers, False)},
}


def _warm(path: Path) -> None:
    """Reads the file once, so that its pages are in the page cache."""
    with open(path, "rb", buffering=0) as f:
        while f.read(64 * 2**20):
            pass


def _loading(config: Config, group: Group) -> None:
    """Streams the per-layer checkpoint into the stacked and the unstacked model, then loads
    one layer into the stacked one."""
    import taktiny.convert as cv
    import taktiny.io as tio

    *_, (width, layers) = SIZES[config.mode]
    model = llama.Llama(llama_config(width, layers), rngs=llama.nn.Rngs(0))
    nbytes = _nbytes(model)
    abstracts = {s: fn(width, layers) for s, fn in ABSTRACTS.items()}
    root = Path(config.scratch)
    root.mkdir(parents=True, exist_ok=True)
    path, one = root / "scanned-model.safetensors", root / "scanned-layer.safetensors"
    try:
        exported = cv.export(llama.UNTIED_RULES, model)
        tio.save_safetensors(path, exported)
        prefix = f"model.layers.{LAYER}."
        tio.save_safetensors(one, {k: v for k, v in exported.items() if k.startswith(prefix)})
        del exported
        _disk.sync(path)
        _disk.sync(one)
        size = _disk.size(path)
        _warm(path)
        _warm(one)
        want = model.flat_state_dict()
        stacked = _load(path, abstracts[STACKED])
        got = tt.flat_state_dict(stacked, unstacked=True)
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert np.array_equal(np.asarray(got[name]), np.asarray(value)), name
        del got
        stats = compare(
            {s: (lambda s=s: jax.block_until_ready(_load(path, abstracts[s]))) for s in RESTORE},
            repeat=config.pick(5, 3, 1),
        )
        # the smoke test measures the case with the target only: a fresh process costs seconds
        measured = [STACKED] if config.mode == "smoke" else list(RESTORE)
        memories = {s: memory._measure(s, path, width, layers, registry="bench.scanned")
                    for s in measured}  # fmt: skip

        # one layer into the concrete stacked model, against the whole load and one copy
        names = [n for n in want if n.startswith(f"layers.{LAYER}.")]
        part = {n: want[n] for n in names}
        block = stacked.layers.block
        touched = jax.tree.leaves(block)  # every stacked leaf has a slice in layer LAYER
        touched_bytes = _nbytes(touched)
        copy = jax.jit(jnp.copy)
        partial = {
            "one layer, load_flat_state_dict": lambda: jax.block_until_ready(
                tt.load_flat_state_dict(stacked, part)
            ),
            "one layer, load_safetensors(strict=False)": lambda: jax.block_until_ready(
                tio.load_safetensors(stacked, one, rules=LAYER_RULES, strict=False, progress=False)
            ),
            "all layers, load_flat_state_dict": lambda: jax.block_until_ready(
                tt.load_flat_state_dict(stacked, want)
            ),
            "floor: one copy of the stacked leaves": lambda: jax.block_until_ready(
                [copy(x) for x in touched]
            ),
        }
        got = tt.flat_state_dict(tt.load_flat_state_dict(stacked, part), unstacked=True)
        assert all(np.array_equal(np.asarray(got[n]), np.asarray(want[n])) for n in names)
        del got
        partials = compare(partial, repeat=config.pick(5, 3, 1))
    finally:
        _disk.remove(path)
        _disk.remove(one)

    gb = f"{nbytes / 1e9:.2f} GB"
    times = Table(
        f"Streaming a per-layer (Hugging Face names) checkpoint of {gb}, warm page cache",
        [STACKED, UNSTACKED],
        reference=STACKED,
    )
    for s, st in stats.items():
        times.add("load_safetensors", s, RESTORE[s][0], st.median, (st.low, st.high))
    share = paired_ratio(stats[UNSTACKED], stats[STACKED])
    mem = Table(f"Peak resident memory (MB) of one load, {gb} model", list(memories), unit="B")
    growth = {}
    for s, r in memories.items():
        growth[s] = (r["peak"] - r["before"]) / nbytes
        mem.add("model bytes", s, RESTORE[s][0], nbytes)
        mem.add("process RSS before the load", s, RESTORE[s][0], r["before"])
        mem.add("peak RSS", s, RESTORE[s][0], r["peak"])
        mem.add("peak RSS growth (peak - before)", s, RESTORE[s][0], r["peak"] - r["before"])
    ratios = Table("Loads: stacked against unstacked, memory against the model's bytes",
                   list(RESTORE), reference=STACKED, unit="x", log=False, line=1.0)  # fmt: skip
    ratios.add("speed: unstacked time / time", STACKED, "median of per-round ratios", share)
    ratios.add("speed: unstacked time / time", UNSTACKED, "itself", 1.0)
    for s in memories:
        ratios.add("peak RSS growth / model bytes", s, RESTORE[s][0], growth[s])
    floor = "floor: one copy of the stacked leaves"
    part_table = Table(
        f"Loading layer {LAYER} alone into the concrete stacked model ({gb})",
        list(partial),
        reference=floor,
    )
    for s, st in partials.items():
        part_table.add("load", s, s, st.median, (st.low, st.high))
    group.tables += [times, ratios, mem, part_table]
    paired = "median of per-round ratios"
    group.targets += [
        Target(
            f"streaming the {gb} per-layer checkpoint into the stacked model >= {LOAD_SHARE:g}x "
            "the speed of loading it into the unstacked model",
            share,
            LOAD_SHARE,
            True,
            f"unstacked time / stacked time, {paired}",
        ),
        Target(
            f"streaming it into the stacked model: peak RSS growth <= {GROWTH:g}x the model's "
            "bytes",
            growth[STACKED],
            GROWTH,
            False,
            "(peak RSS - RSS just before the load) / model bytes, fresh subprocess",
        ),
    ]
    to_floor = {s: paired_ratio(partials[s], partials[floor]) for s in partial if s != floor}
    group.notes += [
        f"The load's model: width {width}, {layers} layers (MLP {width * 11 // 4}, "
        f"{max(4, width // 128)} heads), vocab {VOCAB}, untied head: {nbytes:,} bytes, the "
        f"file {size:,} bytes, written by save_safetensors(path, convert.export(UNTIED_RULES, "
        "model)) with Hugging Face's names and layout (weight [out, in]). Both loads are "
        "checked against the model's values once. The file is read once before the timing "
        f"(warm page cache); {config.pick(5, 3, 1)} interleaved rounds after a warm-up.",
        "Memory: each load in a fresh subprocess (bench.memory's worker, one at a time), "
        "'before' its resident memory after importing taktiny.io and building the abstract "
        "model; peak is VmHWM. Load time inside the worker: "
        + ", ".join(f"{s} {r['seconds']:.2f} s" for s, r in memories.items())
        + ".",
        f"Partial load: layer {LAYER}'s {len(names)} tensors ({_nbytes(part) / 1e6:,.1f} MB) "
        f"into the stacked model, whose {len(touched)} stacked leaves each hold a slice of "
        f"it ({touched_bytes / 1e6:,.0f} MB). JAX arrays are immutable, so every stacked "
        "leaf a layer touches is copied once, and the old model keeps its own: the floor is "
        "the bytes of the stacked leaves touched, not the layer's, timed as one jitted "
        "jnp.copy of each. Partial load / floor (median of per-round ratios): "
        + ", ".join(f"{s} {r:.2f}x" for s, r in to_floor.items())
        + ". The full per-layer load fills fresh zeros and writes every slice.",
    ]


def run(config: Config) -> Group:
    """Times compiles and steps, scanned against unrolled, then the loads."""
    start = time.perf_counter()
    group = Group("scanned", "Scanned layers (nn.Stack) against a list of layers")
    _training(config, group)
    _loading(config, group)
    group.seconds = time.perf_counter() - start
    return group
