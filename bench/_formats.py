"""The 1 GB model and every system's way to write and read it, shared by ``checkpoint``
(timing) and ``memory`` (peak RSS in a subprocess per case).

Saves end with an fsync of every file written, so each time is to durable bytes;
reads start from a cold page cache (the files' cached pages are dropped first).
Orbax, PyTorch and safetensors are imported only by the cases that use them, so that
a memory worker's baseline holds only what its own case needs.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
from jax.sharding import SingleDeviceSharding

from taktiny import nn

from ._disk import read_raw, save_raw

# (width, depth): `depth` Linear(width, width) layers; 4096 x 16 is 1.07 GB of float32
SIZES = {"full": (4096, 16), "quick": (1024, 16), "smoke": (32, 2)}
# The Orbax settings that close the gaps (see FINDINGS.md): no zstd (random-looking float
# weights barely compress, ~8%, and compressing costs far more time than the bytes saved),
# and at most 0.1 GB of reads in flight, so a restore holds little besides the arrays
TUNED = {"use_compression": False, "restore_concurrent_gb": 0.1}
# "chunked" adds 16 MiB chunks to TUNED instead of one chunk per array: a chunk's read
# buffer then stays under glibc's 32 MiB mmap ceiling and is reused, where a 64 MiB chunk
# is a fresh mapping whose every page faults on each read (faster, some more memory)
CHUNK_BYTES = 16 * 2**20


class Big(nn.Module):
    def __init__(self, width: int, depth: int, *, rngs: nn.Rngs):
        self.layers = [nn.Linear(width, width, rngs=rngs) for _ in range(depth)]


@functools.cache
def _torch_big() -> type:
    import torch

    class TorchBig(torch.nn.Module):
        def __init__(self, width: int, depth: int):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(width, width) for _ in range(depth)])

    return TorchBig


def abstract(width: int, depth: int) -> Any:
    """The Taktiny model as shapes only (``jax.eval_shape``), placed on the first device."""
    shapes = jax.eval_shape(lambda: Big(width, depth, rngs=nn.Rngs(0)))
    where = SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where), shapes)


def plain_dict(model: Any) -> dict[str, Any]:
    """The same leaves as a nested dict built by hand, for Orbax without Taktiny."""
    layers = {str(i): {"kernel": x.kernel, "bias": x.bias} for i, x in enumerate(model.layers)}
    return {"layers": layers}


def models(width: int, depth: int) -> dict[str, Any]:
    """The concrete models the saves write: Taktiny's, its plain dict, and PyTorch's."""
    model = Big(width, depth, rngs=nn.Rngs(0))
    return {"taktiny": model, "dict": plain_dict(model), "torch": _torch_big()(width, depth)}


def abstracts(width: int, depth: int) -> dict[str, Any]:
    """What the restores read into: the abstract Taktiny model, and a meta-device PyTorch one."""

    def meta_torch() -> Any:
        import torch

        with torch.device("meta"):
            return _torch_big()(width, depth)

    return {"taktiny": abstract(width, depth), "torch": meta_torch}


# --- each system's save(path, models) and restore(path, abstracts) ----------------------


def _orbax(tuned: bool) -> Any:
    import orbax.checkpoint as ocp

    if tuned:
        return ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(**TUNED))
    return ocp.StandardCheckpointer()


def save_orbax(path: Path, tree: Any, *, tuned: bool = False, chunk: int | None = None) -> None:
    import orbax.checkpoint as ocp

    with _orbax(tuned) as checkpointer:
        if tuned:
            save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=chunk), tree)
            checkpointer.save(path, args=ocp.args.PyTreeSave(tree, save_args=save_args))
        else:
            checkpointer.save(path, tree)
        checkpointer.wait_until_finished()


def restore_orbax(path: Path, target: Any, *, tuned: bool = False) -> Any:
    import orbax.checkpoint as ocp

    with _orbax(tuned) as checkpointer:
        if not tuned:
            return checkpointer.restore(path, target=target)
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        return checkpointer.restore(
            path, args=ocp.args.PyTreeRestore(target, restore_args=restore_args)
        )


def _save_safetensors(path: Path, models: dict[str, Any]) -> None:
    import safetensors.flax

    safetensors.flax.save_file(models["taktiny"].flat_state_dict(), path)


def _load_safetensors(path: Path, abstracts: dict[str, Any]) -> Any:
    import safetensors.flax

    return abstracts["taktiny"].load_flat_state_dict(safetensors.flax.load_file(path), strict=True)


def _save_torch(path: Path, models: dict[str, Any]) -> None:
    import torch

    torch.save(models["torch"].state_dict(), path)


def _load_torch(path: Path, abstracts: dict[str, Any]) -> Any:
    import torch

    model = abstracts["torch"]()
    model.load_state_dict(torch.load(path, weights_only=True), assign=True)
    return model


def _load_orbax(path: Path, abstracts: dict[str, Any], tuned: bool = False) -> Any:
    model = abstracts["taktiny"]
    return model.load_state_dict(restore_orbax(path, model.state_dict(), tuned=tuned), strict=True)


NEEDS = {  # the modules a case imports on first use: memory workers import them up front
    "Taktiny + Orbax": ["orbax.checkpoint"],
    "dict + Orbax": ["orbax.checkpoint"],
    "Taktiny + Orbax tuned": ["orbax.checkpoint"],
    "Taktiny + Orbax chunked": ["orbax.checkpoint"],
    "Taktiny + safetensors": ["safetensors.flax"],
    "PyTorch": ["torch"],
    "raw disk (numpy)": [],
}

SAVE = {  # system -> (the call the report shows, save(path, models))
    "Taktiny + Orbax": (
        "StandardCheckpointer().save(path, model.state_dict())",
        lambda p, m: save_orbax(p, m["taktiny"].state_dict()),
    ),
    "dict + Orbax": (
        "StandardCheckpointer().save(path, params)",
        lambda p, m: save_orbax(p, m["dict"]),
    ),
    "Taktiny + Orbax tuned": (
        "same, with PyTreeCheckpointHandler(use_compression=False)",
        lambda p, m: save_orbax(p, m["taktiny"].state_dict(), tuned=True),
    ),
    "Taktiny + Orbax chunked": (
        "same as tuned, with SaveArgs(chunk_byte_size=16 MiB) for every leaf",
        lambda p, m: save_orbax(p, m["taktiny"].state_dict(), tuned=True, chunk=CHUNK_BYTES),
    ),
    "Taktiny + safetensors": (
        "safetensors.flax.save_file(model.flat_state_dict(), path)",
        _save_safetensors,
    ),
    "PyTorch": ("torch.save(model.state_dict(), path)", _save_torch),
    "raw disk (numpy)": (
        "file.write(array bytes) per leaf, then fsync",
        lambda p, m: save_raw(p, jax.tree.leaves(m["taktiny"])),
    ),
}

RESTORE = {  # system -> (the call the report shows, restore(path, abstracts))
    "Taktiny + Orbax": (
        "abstract.load_state_dict(restore(path, target=abstract.state_dict()))",
        _load_orbax,
    ),
    "dict + Orbax": (
        "StandardCheckpointer().restore(path, target=abstract_params)",
        lambda p, a: restore_orbax(p, plain_dict(a["taktiny"])),
    ),
    "Taktiny + Orbax tuned": (
        "same, PyTreeCheckpointHandler(use_compression=False, restore_concurrent_gb=0.1)",
        lambda p, a: _load_orbax(p, a, tuned=True),
    ),
    "Taktiny + Orbax chunked": (
        "same as tuned (the chunk size is in the checkpoint)",
        lambda p, a: _load_orbax(p, a, tuned=True),
    ),
    "Taktiny + safetensors": (
        "abstract.load_flat_state_dict(safetensors.flax.load_file(path))",
        _load_safetensors,
    ),
    "PyTorch": (
        "meta_model.load_state_dict(torch.load(path, weights_only=True), assign=True)",
        _load_torch,
    ),
    "raw disk (numpy)": (
        "file.read() of the whole file, then np.frombuffer views",
        lambda p, a: read_raw(p, jax.tree.leaves(a["taktiny"])),
    ),
}
