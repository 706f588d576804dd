"""A Hugging Face folder in one call (`from_pretrained`), and back (`save_pretrained`): the
family its ``config.json`` names (`FAMILIES`), the rules between its names and the
model's (`rules`), from a local folder or object storage."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from jax.typing import DTypeLike

from .. import convert, io, nn
from ..sharding import shard
from . import _decoder, _encoder
from ._decoder import Decoder, DecoderConfig
from ._encoder import Encoder, EncoderConfig

FAMILIES: dict[str, type[Decoder] | type[Encoder]] = {
    **dict.fromkeys(_decoder.TYPES, Decoder),
    **dict.fromkeys(_encoder.TYPES, Encoder),
}
"""Each ``model_type`` of a ``config.json`` that :func:`from_pretrained` builds, and the
class that builds it."""

_BITS = {"int8": 8, "int4": 4}
# Megatron's split of a layer over the mesh axis "model" (as transformers' tensor-parallel
# plans split them): the projections into the heads and the MLP by columns, those out of
# them by rows; a pattern with `*` for the layer serves a list of layers and a stack
_ATTENTION_SPLIT = {
    "layers.*.attention.query.kernel": (None, "model"),
    "layers.*.attention.key.kernel": (None, "model"),
    "layers.*.attention.value.kernel": (None, "model"),
    "layers.*.attention.out.kernel": ("model", None),
}
_SPLIT: dict[type[Decoder] | type[Encoder], dict[str, tuple[str | None, ...]]] = {
    Decoder: {
        **_ATTENTION_SPLIT,
        "layers.*.mlp.gate.kernel": (None, "model"),
        "layers.*.mlp.up.kernel": (None, "model"),
        "layers.*.mlp.down.kernel": ("model", None),
    },
    Encoder: {
        **_ATTENTION_SPLIT,
        "layers.*.intermediate.kernel": (None, "model"),
        "layers.*.output.kernel": ("model", None),
    },
}


def rules(
    config: DecoderConfig | EncoderConfig, *, prefix: str = "", pooler: bool = True
) -> list[Any]:
    """The conversion rules between a Hugging Face checkpoint's names and the model's, both
    ways (``load_safetensors(rules=)`` or ``convert.convert`` in, ``convert.export`` out).

    Args:
        config: the model's config: a decoder's (its biases, q/k norms and tied head
            decide its rules) or an encoder's.
        prefix: (encoders) what every name in the files starts with: ``""`` for a
            ``BertModel``'s, ``"bert."`` for those of ``BertForPreTraining``,
            ``BertForMaskedLM`` and the other heads on a BERT, whose ``cls.**`` names are
            then dropped. Export with ``""`` to write a ``BertModel``'s names.
        pooler: (encoders) whether the model has BERT's pooler (``pooler.dense``).

    Returns:
        The rules: each weight ``[out, in]`` transposed into a kernel, the norms'
        ``weight`` into ``scale``, a tied head read as the embedding (and left out on
        export), the buffers older files hold (``inv_freq``, ``position_ids``) dropped.

    Raises:
        ValueError: a decoder's rules given `prefix` or ``pooler=False`` (they have
            neither), or a prefix that does not end with a dot.
    """
    if isinstance(config, EncoderConfig):
        return _encoder.rules(config, prefix=prefix, pooler=pooler)
    if prefix or not pooler:
        raise ValueError(
            f"taktiny.models.rules: prefix= and pooler= are an encoder's; a decoder's "
            f"({config.model_type}) names have no prefix and it has no pooler."
        )
    return _decoder.rules(config)


def from_pretrained(
    path: str | os.PathLike[str],
    *,
    dtype: DTypeLike = jnp.float32,
    scanned: bool = False,
    quantize: str | None = None,
    group_size: int | None = None,
    sharding: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
    mesh: Mesh | None = None,
    max_host_bytes: int | str | None = None,
    progress: bool | None = None,
) -> Decoder | Encoder:
    """The model a Hugging Face folder holds (its ``config.json`` and safetensors files),
    streamed into the model its ``model_type`` names (:data:`FAMILIES`), built without
    initialising it: each tensor goes from the file (or the object) onto its leaf's
    devices, quantized or sharded on the way if asked.

    Folders whose ``config.json`` has a ``quantization_config`` (FP8 block-scaled weights,
    compressed-tensors int4/int8) load too: their weights are dequantized into `dtype`,
    or quantized again as `quantize` asks (:func:`taktiny.convert.quantized_rules`). An
    encoder's files from a head on BERT (``bert.`` names, ``cls.*`` heads) load into the
    encoder, the heads dropped; a pooler is built when the files hold one.

    Args:
        path: the folder (transformers' ``save_pretrained`` or :func:`save_pretrained`
            wrote it), local or in object storage (``s3://bucket/folder``, ``gs://``,
            ``az://``: docs/storage.md).
        dtype: the parameters' dtype (the files' values are cast into it, each checked).
        scanned: hold the layers as one ``nn.Stack`` (each layer's tensors stream into
            their slices).
        quantize: ``"int8"`` or ``"int4"``: the layers' linear projections held quantized
            (:func:`taktiny.quantize` with ``where="layers.**"``: the embeddings and the
            output head stay in `dtype`), each float tensor quantized as it arrives, so the
            host never holds the float model. None (the default): not quantized.
        group_size: with `quantize`, entries per scale along a kernel's input axis; None
            (the default) for one scale per output channel.
        sharding: ``tt.shard`` rules over the model's names (``{"layers.*.mlp.up.kernel":
            (None, "model")}``), placing each leaf before it is read. None with a `mesh`:
            the layers split over the mesh's ``"model"`` axis as Megatron splits them (the
            projections into the heads and the MLP by columns, those out of them by rows;
            everything else replicated).
        mesh: the mesh of `sharding`; by default the one of the enclosing ``jax.set_mesh``.
            Without both, the model goes onto the default device.
        max_host_bytes: the most host memory the load holds beyond the model's own
            arrays (``load_safetensors``'s budget: an int, or ``"512MiB"``).
        progress: show a progress bar; None shows one for checkpoints over 256 MiB.

    Returns:
        The model (a :class:`Decoder` or an :class:`Encoder`), every parameter loaded
        (strictly: a missing or unexpected tensor is an error naming it).

    Raises:
        ValueError: the folder holds no ``config.json`` (the message lists what it holds),
            its ``model_type`` is not in :data:`FAMILIES` (the message lists them), its
            config asks for what the model does not compute, `quantize` is neither
            ``"int8"`` nor ``"int4"`` (or `group_size` comes without it), or a mesh
            without a ``"model"`` axis is given no `sharding`.
        taktiny.StateDictError: the files do not fit the model (every problem named).
    """
    where = io.locate(os.fspath(path))
    values = _config(where)
    family = values.get("model_type")
    made = FAMILIES.get(family) if isinstance(family, str) else None
    if made is None:
        raise ValueError(
            f"taktiny.models.from_pretrained: {str(path)!r} holds a model of model_type "
            f"{family!r}; it builds {', '.join(map(repr, FAMILIES))}. For another model, "
            f"write its modules and rules (docs/converting.md)."
        )
    if quantize is not None and quantize not in _BITS:
        raise ValueError(
            f"taktiny.models.from_pretrained: quantize={quantize!r}; give 'int8', 'int4' or None."
        )
    if group_size is not None and quantize is None:
        raise ValueError(
            f"taktiny.models.from_pretrained: group_size={group_size!r} is quantize's; give "
            f"quantize='int8' or 'int4' with it, or leave it out."
        )
    checkpoint = io.open_safetensors(os.fspath(path))
    names = set(checkpoint)
    if made is Decoder:
        config: Any = DecoderConfig.from_hf(values)
        build: Any = lambda: Decoder(config, scanned=scanned, param_dtype=dtype, rngs=nn.Rngs(0))
        made_rules = rules(config)
    else:
        config = EncoderConfig.from_hf(values)
        prefix = "bert." if any(n.startswith("bert.") for n in names) else ""
        pooler = f"{prefix}pooler.dense.weight" in names
        build = lambda: Encoder(
            config, scanned=scanned, param_dtype=dtype, pooler=pooler, rngs=nn.Rngs(0)
        )
        made_rules = rules(config, prefix=prefix, pooler=pooler)
    if "quantization_config" in values:
        made_rules = convert.quantized_rules(made_rules, checkpoint, config=values)
    model = jax.eval_shape(build)
    if quantize is not None:
        model = nn.quantize(model, bits=_BITS[quantize], group_size=group_size, where="layers.**")
    if sharding is not None or mesh is not None:
        model = shard(model, _split(made, sharding, mesh), mesh)
    return io.load_safetensors(
        model, checkpoint, rules=made_rules, max_host_bytes=max_host_bytes, progress=progress
    )


def save_pretrained(model: Decoder | Encoder, path: str | os.PathLike[str]) -> list[Any]:
    """Writes `model` as a Hugging Face folder: ``model.safetensors`` in Hugging Face's
    names and layouts, and the ``config.json`` transformers builds the model from
    (transformers' ``from_pretrained`` loads it with nothing missing or unexpected: a
    decoder as its ``*ForCausalLM``, an encoder as ``BertModel``). A quantized model
    (``from_pretrained(quantize=...)``, :func:`taktiny.quantize`) is written as
    compressed-tensors (its integers packed and its scales as they are, the
    ``quantization_config`` in ``config.json``), which transformers decompresses to
    exactly its dequantized weights and :func:`from_pretrained` loads back bit for bit;
    ``tt.dequantize(model)`` first writes it in float. A sharded model is written from
    its devices.

    Args:
        model: the decoder or the encoder.
        path: the folder, local (made if missing) or in object storage; its two files
            are replaced, each whole.

    Returns:
        The files written (paths or URLs).
    """
    where = io.locate(os.fspath(path))
    if isinstance(model, Encoder):
        made_rules = rules(model.config, pooler=model.pooler is not None)
        dtype = model.word.embedding.dtype
    else:
        made_rules = rules(model.config)
        dtype = model.embed.embedding.dtype
    config: dict[str, Any] = model.config.to_hf()
    config["torch_dtype"] = str(jnp.dtype(dtype))
    if isinstance(where, Path):
        where.mkdir(parents=True, exist_ok=True)
    if _quantized(model):
        tensors, config["quantization_config"] = convert.export_compressed_tensors(
            made_rules, model
        )
    else:
        tensors = convert.export(made_rules, model)
    written = io.save_safetensors(str(where / "model.safetensors"), tensors)
    text = (json.dumps(config, indent=2) + "\n").encode()
    if isinstance(where, Path):
        partial = where / ".config.json.partial"
        partial.write_bytes(text)
        partial.replace(where / "config.json")
    else:
        io.put_object(where / "config.json", text)
    return [*written, where / "config.json"]


def _config(where: Any) -> dict[str, Any]:
    """The ``config.json`` of the folder `where` (a Path or a Url), read."""
    file = where / "config.json"
    try:
        storage = io.open_storage(file)
    except FileNotFoundError:
        if isinstance(where, Path):
            held = sorted(p.name for p in where.iterdir()) if where.is_dir() else None
            found = f"it holds {held}" if held is not None else "no such folder"
        else:
            found = "no such object"
        raise ValueError(
            f"taktiny.models.from_pretrained: {str(where)!r} has no config.json ({found}); "
            f"give the folder Hugging Face's save_pretrained (or save_pretrained here) wrote."
        ) from None
    try:
        return json.loads(io.read_range(storage, 0, storage.size))
    finally:
        storage.close()


def _split(made: Any, sharding: Any, mesh: Mesh | None) -> Any:
    """`sharding`, or for None the Megatron split of `made`'s layers over the mesh's
    ``"model"`` axis (refused, naming the axes, when it has none)."""
    if sharding is not None:
        return sharding
    axes = (mesh or jax.sharding.get_abstract_mesh()).axis_names
    if "model" not in axes:
        raise ValueError(
            f"taktiny.models.from_pretrained: the mesh has the axes {tuple(axes)}; the "
            f"default split places the layers over an axis named 'model'. Name one so, or "
            f"give sharding= (tt.shard's rules over the model's names)."
        )
    return {name: PartitionSpec(*spec) for name, spec in _SPLIT[made].items()}


def _quantized(model: Any) -> bool:
    """Whether `model` holds a quantized linear layer (compressed-tensors holds those; a
    quantized embedding is refused by the export, naming the fix)."""
    is_layer = lambda x: isinstance(x, nn.QuantizedLinear)
    return any(is_layer(x) for x in jax.tree.leaves(model, is_leaf=is_layer))
