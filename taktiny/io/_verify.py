"""Checking a safetensors checkpoint's headers, and its bytes against the checksums in
them, tensor by tensor (what ``taktiny verify`` runs)."""

from __future__ import annotations

import os
from typing import NamedTuple

from . import _checksum
from ._checkpoint import open_safetensors
from ._errors import SafetensorsError
from ._header import SCHEMA_KEY


class Verified(NamedTuple):
    """What :func:`verify` found: the tensors whose bytes matched their checksums, those
    without a checksum (written by another program: only their headers were checked), and
    one line for each damaged tensor, naming its file and both checksums."""

    checked: int
    unchecked: int
    damaged: list[str]


def verify(path: str | os.PathLike[str]) -> Verified:
    """Reads every tensor of the checkpoint at `path` (a file, an index or a folder, as
    :func:`~taktiny.io.open_safetensors` takes them) through its checksum, 4 MiB at a time,
    after its headers: each one Taktiny wrote is checked against the digest it records of
    itself (its checksums and schema among its bytes); one an older Taktiny wrote, without
    that digest, by its schema's fingerprint.

    Raises:
        SafetensorsError: for a checkpoint whose headers or index cannot be read, or a
            header that is damaged (naming what in it changed).
    """
    checkpoint = open_safetensors(path)  # (a header Taktiny sealed is checked whole)
    if _checksum.HEADER_KEY not in checkpoint.metadata and SCHEMA_KEY in checkpoint.metadata:
        checkpoint.schema  # noqa: B018  (an older Taktiny's file: its schema's fingerprint)
    checked, unchecked, damaged = 0, 0, []
    for tensor in checkpoint.values():
        if tensor.checksum is None:
            unchecked += 1
            continue
        try:
            tensor.verify()
            checked += 1
        except SafetensorsError as error:
            damaged.append(str(error))
    return Verified(checked, unchecked, damaged)
