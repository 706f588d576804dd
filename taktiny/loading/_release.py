"""What JAX holds of the host memory a load read into, let go of as the load ends.

A copy of host memory onto a device that copies it (a TPU's, a GPU's: ``jax.device_put``,
or a program given host arrays) holds the host array until the copy has read it, and JAX
lets go of it only at its next garbage collection after that (JAX runs its own collection
from Python's ``gc.callbacks``: jax-ml/jax#14882). So the file's mapped pages, the scratch
buffers and the staging ring of a load stayed mapped after it returned, and whatever
Python code allocated next paid for their unmapping: on a TPU v5e's host, the next
load's planning took 12-24 ms instead of 3 (18 ms to unmap 0.5 GiB; bench/FINDINGS.md
section 14). A CPU device instead adopts a view of the scratch buffer a transformed step
is read into, and JAX lets go of that, too, only at its next collection: the buffer, as
large as the load's largest such tensor, outlived the load. A load onto devices that copy,
or with scratch buffers, hands its result to `release` as it ends: it waits until the
copies have ended (the arrays are ready), then runs a collection of the youngest
generation, whose callback has JAX let go. The buffers are then unmapped by the load that
mapped them, not at some later collection: in a training step, or inside the next load.
The collection runs in the load's own thread: run on another,
it could make a caller's own ``gc.collect()`` return having collected nothing (Python
runs one collection at a time, and a second asked meanwhile does nothing), and a
measurement of a load's memory found the previous load's buffers still held.

The collection does not unmap the file's windows, though: `release` takes them from the
load's storages first (``Storage.take_mappings``), so that the collection leaves them
mapped, and hands them to a reader thread, which unmaps them (``mmap.close``) while the
caller goes on. Unmapped in the load's thread, they held every load onto the TPU up by
what unmapping costs there, 35 ms for 1 GiB: the plain load of a 1 GiB file ran at
7.7-7.9 GiB/s, 0.69x the raw limit, against 10.9-11.1 with the unmapping off the load's
thread (bench/FINDINGS.md section 14, twentieth session). A window a view still reads (a
`Tensor.mapped` the caller kept, another load's copy) refuses to close; it goes with its
last view.
"""

from __future__ import annotations

import gc
import mmap
from collections.abc import Iterable
from typing import Any

import jax

from ..io import Storage
from ._readers import reader_pool


def release(tree: Any, storages: Iterable[Storage]) -> None:
    """Waits until every array of `tree` is ready, then has JAX let go of the host memory
    the copies that made them read; the mappings of `storages` are unmapped on a reader
    thread (see the module)."""
    mappings = [m for storage in storages for m in storage.take_mappings()]
    for leaf in jax.tree.leaves(tree):  # (a leaf kept as it was may have been donated)
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.block_until_ready()  # (the copies that read host memory have ended)
    gc.collect(0)  # (JAX's callback lets go of what they read; `mappings` holds the windows)
    if mappings:
        reader_pool().submit(_unmapped, mappings)


def _unmapped(mappings: list[mmap.mmap]) -> None:
    """Unmaps each of `mappings` that no view reads (outside the GIL); the others go with
    their last view."""
    for mapping in mappings:
        try:
            mapping.close()
        except BufferError:  # (a view of it lives)
            pass
