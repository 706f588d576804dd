"""A Hugging Face folder in one call (`from_pretrained`), and back (`save_pretrained`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from .. import convert, nn
from ..io import load_safetensors, save_safetensors
from ._decoder import Decoder, DecoderConfig, rules


def from_pretrained(
    folder: str | Path, *, dtype: DTypeLike = jnp.float32, scanned: bool = False
) -> Decoder:
    """The model a Hugging Face folder holds (its ``config.json`` and safetensors files),
    streamed into a :class:`Decoder` built without initialising it.

    Args:
        folder: the folder ``save_pretrained`` wrote (transformers' or :func:`save_pretrained`).
        dtype: the parameters' dtype (the file's values are cast into it, each checked).
        scanned: hold the layers as one ``nn.Stack`` (each layer's tensors stream into
            their slices).

    Returns:
        The model, every parameter loaded (strictly: a missing or unexpected tensor is
        an error naming it).

    Raises:
        ValueError: `folder` is a URL or holds no config.json, or the config.json is not
            one of the Llama family's (its message lists the families).
        taktiny.StateDictError: the files do not fit the model (every problem named).
    """
    if "://" in str(folder):
        raise ValueError(
            f"taktiny.models.from_pretrained reads a local folder; {str(folder)!r} is a URL. "
            f"Load from object storage with taktiny.io.load_safetensors(model, url, "
            f"rules=models.rules(config)), the model built from the folder's config.json."
        )
    path = Path(folder) / "config.json"
    if not path.is_file():
        held = sorted(p.name for p in Path(folder).iterdir()) if Path(folder).is_dir() else None
        raise ValueError(
            f"taktiny.models.from_pretrained: {str(folder)!r} has no config.json"
            + (f" (it holds {held})" if held is not None else " (no such folder)")
            + "; give the folder Hugging Face's save_pretrained (or save_pretrained here) wrote."
        )
    config = DecoderConfig.from_hf(path)
    abstract = jax.eval_shape(
        lambda: Decoder(config, scanned=scanned, param_dtype=dtype, rngs=nn.Rngs(0))
    )
    return load_safetensors(abstract, folder, rules=rules(config))


def save_pretrained(model: Decoder, folder: str | Path) -> list[Any]:
    """Writes `model` as a Hugging Face folder: ``model.safetensors`` in Hugging Face's
    names and layouts, and the ``config.json`` transformers builds the model from
    (``from_pretrained`` of transformers loads it with nothing missing or unexpected).

    Args:
        model: the decoder.
        folder: the folder to write (made if missing; its two files replaced).

    Returns:
        The files written (paths).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = model.config.to_hf()
    config["torch_dtype"] = str(jnp.dtype(model.embed.embedding.dtype))
    written = save_safetensors(
        folder / "model.safetensors", convert.export(rules(model.config), model)
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return [*written, folder / "config.json"]
