"""Multi-host training with Taktiny: every process (one per host) runs this same program.

It builds a model sharded over a mesh of all global devices, trains it a step with optax,
checkpoints model and optimizer state with Orbax (and the weights alone as safetensors),
and restores both onto a mesh of another shape, checking every restored value bit for bit
against what the saving run held; the weights are also streamed from the safetensors file
onto the new mesh, each process reading only the bytes of its own shards. See
docs/distributed.md.

On one machine, as 2 processes of 4 simulated CPU devices each (start both; any free port):

    export JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=4
    python examples/distributed.py save /tmp/run --mesh 2,4 \
        --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 0   # and --process-id 1
    python examples/distributed.py restore /tmp/run --mesh 4,2 ...      # the same flags

On a GPU or TPU pod: the same command on every host, without the last three flags
(`jax.distributed.initialize()` finds the cluster), on a directory all hosts share.
With no arguments: one process of 8 simulated CPU devices saves, then restores.
"""

import argparse
import tempfile
from pathlib import Path

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

import taktiny as tt
from taktiny import nn

VOCAB, DIM, HIDDEN, BATCH, SEQ = 64, 32, 128, 16, 8
RULES = {  # "model" splits the features (tensor parallel), "data" the batch
    "embed.embedding": (None, "model"),
    "hidden.kernel": (None, "model"),
    "hidden.bias": ("model",),
    "out.kernel": ("model", None),
}
optimizer = optax.adam(1e-2)


class Model(nn.Module):
    def __init__(self, *, rngs: nn.Rngs):
        self.embed = nn.Embed(VOCAB, DIM, rngs=rngs)
        self.hidden = nn.Linear(DIM, HIDDEN, rngs=rngs)
        self.out = nn.Linear(HIDDEN, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        return self.out(jax.nn.relu(self.hidden(self.embed(tokens))))


def make_mesh(shape):
    """A (data, model) mesh of all global devices, with Auto axes: the compiler places the
    activations (Explicit axes, JAX 0.10's default, want each ambiguous one placed by hand)."""
    return jax.make_mesh(shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def shardings(tree):
    return jax.tree.map(lambda leaf: leaf.sharding, tree)


def abstract_state(mesh):
    """Model and optimizer state as sharded ShapeDtypeStructs on `mesh`: nothing allocated."""
    model = tt.shard(tt.eval_shape(lambda: Model(rngs=nn.Rngs(0))), RULES, mesh)
    return model, tt.eval_shape(optimizer.init, model)


def train_step(model, opt_state, tokens):
    def loss_fn(model):
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(model)
    with jax.numpy_dtype_promotion("standard"):  # adam's step mixes int32 and float32
        updates, opt_state = optimizer.update(grads, opt_state, model)
    return optax.apply_updates(model, updates), opt_state, loss


def train(mesh, model, opt_state, step):
    """One step on the global batch; each process makes only the rows its devices hold."""
    tokens = np.random.default_rng(step).integers(0, VOCAB, (BATCH, SEQ + 1), dtype=np.int32)
    placed = jax.NamedSharding(mesh, jax.P("data"))
    tokens = jax.make_array_from_callback(tokens.shape, placed, lambda index: tokens[index])
    out = (tt.sharding_plan(model, RULES, mesh).shardings, shardings(opt_state), None)
    model, opt_state, loss = jax.jit(train_step, out_shardings=out)(model, opt_state, tokens)
    print(f"process {jax.process_index()}: step {step} loss {float(loss):.4f}")
    return model, opt_state


def _key(name, index):
    """An npz entry name for the shard of `name` at `index` (a tuple of slices)."""
    return name + "@" + ",".join(f"{s.start}:{s.stop}" for s in index)


def _index(text):
    return tuple(slice(*(None if n == "None" else int(n) for n in s.split(":")))
                 for s in text.split(",") if s)  # fmt: skip


def local_shards(state):
    """{entry: values}: the shards this process holds, one copy of each."""
    return {
        _key(name, s.index): np.asarray(s.data)
        for name, leaf in tt.flat_state_dict(state).items()
        for s in leaf.addressable_shards
        if s.replica_id == 0
    }


def save(path, mesh):
    abstract, abstract_opt = abstract_state(mesh)
    # each device computes only its own shard of the initial parameters and moments
    model = jax.jit(lambda: Model(rngs=nn.Rngs(0)), out_shardings=shardings(abstract))()
    opt_state = jax.jit(optimizer.init, out_shardings=shardings(abstract_opt))(model)
    model, opt_state = train(mesh, model, opt_state, step=0)
    state = {"model": model.state_dict(), "opt": tt.state_dict(opt_state)}
    with ocp.StandardCheckpointer() as checkpointer:  # every process calls save
        checkpointer.save(path / "checkpoint", state)
    # the weights for inference: gathered (every process takes part), written by one
    weights = multihost_utils.process_allgather(model.state_dict(), tiled=True)
    if jax.process_index() == 0:
        tt.io.save_safetensors(path / "weights.safetensors", weights)
    # what the restore run compares against (a test aid, not part of the recipe)
    np.savez(path / f"reference-{jax.process_index()}.npz", **local_shards(state))


def restore(path, mesh):
    abstract, abstract_opt = abstract_state(mesh)  # the new mesh's shardings are the target
    target = {"model": abstract.state_dict(), "opt": tt.state_dict(abstract_opt)}
    with ocp.StandardCheckpointer() as checkpointer:  # every process calls restore
        state = checkpointer.restore(path / "checkpoint", target=target)
    model = abstract.load_state_dict(state["model"], strict=True)
    opt_state = tt.load_state_dict(abstract_opt, state["opt"], strict=True)
    check(path, {"model": model.state_dict(), "opt": tt.state_dict(opt_state)}, target)
    train(mesh, model, opt_state, step=1)  # and training resumes
    # the safetensors weights, streamed onto the new mesh: each process reads its shards
    streamed = tt.io.load_safetensors(abstract, path / "weights.safetensors")
    check(path, {"model": streamed.state_dict()}, {"model": target["model"]})


def check(path, state, target):
    """Each process compares the shards it holds with what all saving processes held."""
    saved = {}
    for file in sorted(path.glob("reference-*.npz")):
        with np.load(file, allow_pickle=False) as entries:
            saved.update({key: entries[key] for key in entries.files})
    targets, shards = tt.flat_state_dict(target), 0
    for name, leaf in tt.flat_state_dict(state).items():
        full, seen = np.zeros(leaf.shape, leaf.dtype), np.zeros(leaf.shape, bool)
        for key, values in saved.items():
            if key.split("@")[0] == name:
                index = _index(key.split("@")[1])
                full[index], seen[index] = values, True
        for shard in leaf.addressable_shards:
            same = np.asarray(shard.data).tobytes() == full[shard.index].tobytes()
            if not (same and seen.all() and leaf.sharding == targets[name].sharding):
                raise SystemExit(f"process {jax.process_index()}: {name} differs at {shard.index}")
            shards += 1
    mesh = dict(leaf.sharding.mesh.shape)
    print(f"process {jax.process_index()}: {len(targets)} leaves restored bitwise equal "
          f"({shards} shards) on mesh {mesh}")  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", nargs="?", choices=["save", "restore"])
    parser.add_argument("path", nargs="?", help="a directory all processes share")
    parser.add_argument("--mesh", default="2,4", help="the (data, model) mesh shape")
    parser.add_argument("--coordinator", help="host:port of process 0")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    args = parser.parse_args()
    if args.mode and not args.path:
        parser.error(f"{args.mode} needs the path of a directory all processes share")
    if args.mode:  # one of several processes: before anything else touches the devices
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    else:  # a try-out on one machine
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
    mesh = make_mesh(tuple(int(n) for n in args.mesh.split(",")))
    print(f"process {jax.process_index()} of {jax.process_count()}: "
          f"{jax.local_device_count()} of {jax.device_count()} devices")  # fmt: skip
    if args.mode == "save":
        save(Path(args.path).absolute(), mesh)
    elif args.mode == "restore":
        restore(Path(args.path).absolute(), mesh)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            save(Path(tmp), mesh)
            restore(Path(tmp), make_mesh(mesh.devices.shape[::-1]))


if __name__ == "__main__":
    main()
