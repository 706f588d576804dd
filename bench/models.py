"""A 1B-class model from a Hugging Face folder in one call (issue 54 point 4): the time and
the host memory of ``taktiny.models.from_pretrained`` against transformers' own
``from_pretrained`` of the same folder, on this machine's CPU.

- The folder: a Llama 3.2 1B-shaped decoder (hidden 2048, 16 layers, 32 heads sharing 8
  key/value heads, MLP 8192, a vocabulary of 128,256, tied head: 1.24 B parameters) with
  random bfloat16 weights, written by ``models.save_pretrained`` (``model.safetensors``
  in Hugging Face's names, 2.47 GB, and its ``config.json``). ``quick`` and ``smoke``
  shrink it.
- Each load runs in a fresh process (``bench.memory``'s worker), from a warm page cache:
  its seconds, and its peak resident memory less the process's just before the call
  (imports done), against the model's own bytes.
- Loads: ``from_pretrained`` into bfloat16, scanned (one ``nn.Stack``), quantized to int8
  and to int4 in groups of 128 on the way in; transformers'
  ``LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)``; and
  ``safetensors.flax.load_file`` of the file (the tensors alone, no model, no renaming:
  a floor).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from ._results import Config, Group, Table, Target
from .memory import _measure

TT, SCANNED, INT8, INT4 = (
    "from_pretrained",
    "from_pretrained, scanned",
    "from_pretrained, int8",
    "from_pretrained, int4 (groups of 128)",
)
HF, FLAX = "transformers", "safetensors.flax"
SYSTEMS = [TT, SCANNED, INT8, INT4, HF, FLAX]
GROWTH = 1.10  # target: a load's peak host growth, x the loaded model's own bytes
FLOAT_SHARE = 0.8  # target: a quantizing load's peak growth, x the float model's bytes
# mode -> the config's (hidden, layers, heads, kv heads, MLP, vocabulary)
SIZES = {
    "full": (2048, 16, 32, 8, 8192, 128256),  # Llama 3.2 1B
    "quick": (1024, 8, 16, 4, 4096, 32000),
    "smoke": (64, 2, 4, 2, 128, 256),
}


def hf_config(mode: str) -> dict[str, Any]:
    """The ``config.json`` of the mode's Llama (Llama 3.2's RoPE scaling)."""
    hidden, layers, heads, kv_heads, mlp, vocab = SIZES[mode]
    return {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": mlp,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }  # fmt: skip


def _from_pretrained(**kwargs: Any) -> Any:
    def load(path: Path, group_size: int) -> Any:
        from taktiny import models

        if kwargs.get("quantize") == "int4":
            kwargs["group_size"] = group_size or None
        return models.from_pretrained(path, dtype=jnp.bfloat16, progress=False, **kwargs)

    return load


def _transformers(path: Path, _: Any) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16)  # (a torch model: no leaves)


def _flax(path: Path, _: Any) -> Any:
    from safetensors.flax import load_file

    return load_file(path / "model.safetensors")


# bench.memory's worker reads these (see its `_worker`)
RESTORE = {
    TT: ("models.from_pretrained(folder, dtype=jnp.bfloat16)", _from_pretrained()),
    SCANNED: ("models.from_pretrained(folder, ..., scanned=True)", _from_pretrained(scanned=True)),
    INT8: (
        "models.from_pretrained(folder, ..., quantize='int8')", _from_pretrained(quantize="int8")
    ),
    INT4: (
        "models.from_pretrained(folder, ..., quantize='int4', group_size=128)",
        _from_pretrained(quantize="int4"),
    ),
    HF: ("LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)", _transformers),
    FLAX: ("safetensors.flax.load_file(folder / 'model.safetensors')", _flax),
}  # fmt: skip
NEEDS = {
    **{system: ["taktiny.models", "taktiny.io"] for system in (TT, SCANNED, INT8, INT4)},
    HF: ["torch", "transformers"],
    FLAX: ["safetensors.flax"],
}
# (each load builds its own model: the worker's `width` carries the int4 group size)
ABSTRACTS = dict.fromkeys(SYSTEMS, lambda width, depth: width)


def _write(folder: Path, mode: str) -> dict[str, int]:
    """The folder of the mode's model, random bfloat16 weights; each variant's bytes."""
    from taktiny import models, nn

    config = models.DecoderConfig.from_hf(hf_config(mode))
    model = models.Decoder(config, param_dtype=jnp.bfloat16, rngs=nn.Rngs(0))
    models.save_pretrained(model, folder)
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
    bits = {INT8: (8, None), INT4: (4, _group(mode))}
    sizes = {TT: nbytes(model), SCANNED: nbytes(model)}
    for name, (count, group) in bits.items():
        shapes = jax.eval_shape(lambda: model)
        quantized = nn.quantize(shapes, bits=count, group_size=group, where="layers.**")
        sizes[name] = sum(_bytes(x) for x in jax.tree.leaves(quantized))
    return sizes


def _bytes(leaf: Any) -> int:
    """An array's bytes, 4-bit integers two to a byte (as JAX holds them)."""
    packed = leaf.dtype in (jnp.int4, jnp.uint4)
    return leaf.size // 2 if packed else leaf.size * leaf.dtype.itemsize


def _group(mode: str) -> int | None:
    """The int4 group size: 128, or one scale per channel for the smoke test's widths."""
    return 128 if SIZES[mode][0] % 128 == 0 else None


def run(config: Config) -> Group:
    """Writes the folder, then loads it in fresh processes, each way, interleaved."""
    start = time.perf_counter()
    mode = config.mode
    group = Group("models", "A 1B-class model from a Hugging Face folder (taktiny.models)")
    folder = Path(config.scratch) / "models-bench"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        sizes = _write(folder, mode)
        file_bytes = (folder / "model.safetensors").stat().st_size
        (folder / "model.safetensors").read_bytes()  # into the page cache
        rounds = config.pick(2, 1, 1)
        found: dict[str, list[dict[str, float]]] = {s: [] for s in SYSTEMS}
        for _ in range(rounds):
            for system in SYSTEMS:
                group_size = _group(mode) or 0
                found[system].append(
                    _measure(system, folder, group_size, 0, registry="bench.models")
                )
    finally:
        for file in folder.iterdir():
            file.unlink()
        folder.rmdir()
    times = Table(f"load of a {file_bytes / 1e9:.2f} GB folder", SYSTEMS, reference=TT)
    memory = Table("peak host memory beyond the process's", SYSTEMS, unit="B", reference=TT)
    for system in SYSTEMS:
        seconds = sorted(r["seconds"] for r in found[system])
        growth = sorted(r["peak"] - r["before"] for r in found[system])
        call = RESTORE[system][0]
        times.add("time", system, call, seconds[len(seconds) // 2], (seconds[0], seconds[-1]))
        memory.add("peak growth", system, call, growth[len(growth) // 2])
    group.tables += [times, memory]
    for system in (TT, SCANNED):
        group.targets.append(
            Target(
                f"{system}: peak host growth <= {GROWTH:g}x the model's bytes",
                memory.value("peak growth", system) / sizes[system],
                GROWTH,
                False,
                "(peak resident - resident before the call) / the model's bytes",
            )
        )
    for system in (INT8, INT4):  # quantized on the way in: the float model never held
        group.targets.append(
            Target(
                f"{system}: peak host growth <= {FLOAT_SHARE:g}x the float model's bytes",
                memory.value("peak growth", system) / sizes[TT],
                FLOAT_SHARE,
                False,
                "(peak resident - resident before the call) / the bfloat16 model's bytes",
            )
        )
    hf = times.value("time", HF)
    group.notes.append(
        f"The folder: {file_bytes / 2**30:.2f} GiB ({mode}); the models' bytes: "
        + ", ".join(f"{s} {sizes[s] / 2**30:.2f} GiB" for s in (TT, INT8, INT4))
        + f". from_pretrained reads {file_bytes / times.value('time', TT) / 2**30:.2f} GiB/s "
        f"into bfloat16, {hf / times.value('time', TT):.2f}x as fast as transformers "
        f"({hf:.2f} s). transformers maps the file and leaves its tensors in the page cache "
        f"until they are used, so its peak counts little of them; safetensors.flax holds "
        f"each tensor twice at some point (a NumPy copy, then JAX's)."
    )
    group.seconds = time.perf_counter() - start
    return group
