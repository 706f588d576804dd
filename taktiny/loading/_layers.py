"""Loading per-layer names into a stack of layers (``nn.Stack``), slice by slice.

A checkpoint written per layer (``model.layers.{i}...`` converted to ``layers.{i}...``)
loads into a model whose stacks hold each parameter once, ``[count, ...]``. The load then
runs on the model's per-layer twin, state's description of its per-layer form
(`taktiny.state.Layers`): each stack replaced by a list of ``count`` blocks, each leaf one
layer's shape and dtype on the stacked leaf's sharding without the layer axis. Every step,
check and plan is the load's own, over per-layer names; state's `Stacker`, the fill the
load of values uses too, puts each layer into its stacked leaf: read straight into a
page-aligned host buffer that JAX adopts (a leaf on one CPU device), or written in place
into the leaf made on its devices. No stacked array is ever assembled beside its parts
(see the README beside this file). Here is what the reads ask of it.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ..io import Tensor
from ..state import Layers, layer_sharding, on_host

SLICES_AT_ONCE = 2  # units in flight when placed slices wait in host memory to be written
# into stacks (`Layered.widest`)


class Layered(Layers):
    """A load of per-layer names into a model's stacks: the model's per-layer form
    (state's `Layers`: each per-layer leaf's stacked leaf and layer, the twin the load
    resolves and plans on), with what the reads ask of it.

    A stacked leaf on one CPU device is filled on the host, each layer read into its slice
    of the buffer JAX adopts (:meth:`in_place`); the slices of any other are placed on its
    devices and wait, holding their memory, until the load's thread writes them into the
    stacked leaf (:meth:`waiting` counts what is host memory for the budget). A load whose
    slices so wait in host memory keeps at most `SLICES_AT_ONCE` units in flight
    (:meth:`widest`).
    """

    def in_place(self, name: str, tensor: Tensor) -> bool:
        """Whether the per-layer leaf `name` is read straight into its stacked leaf's host
        buffer (a hosted stacked leaf; a tensor stored as it is held, not packed)."""
        hit = self.slice_of(name)
        return hit is not None and not tensor.packed and self.hosted(hit[0])

    def widest(self, most: int) -> int:
        """The most units a load keeps in flight, of `most` readers: `SLICES_AT_ONCE` when
        the placed slices of some stacked leaf wait in host memory (a stack on CPU devices
        that is not hosted: :meth:`waiting`), so that the host holds few of them beside the
        model; else all of them (every stack hosted, or on devices that copy host memory,
        a TPU's or a GPU's, whose slices wait in the devices' own memory)."""
        return min(most, SLICES_AT_ONCE) if self._slices_on_host else most

    @functools.cached_property
    def _slices_on_host(self) -> bool:
        spec = self.view.spec
        return any(
            not self.hosted(n) and on_host(self.sharding(n))
            for n in spec.names
            if spec.stack_of(n) is not None
        )

    def waiting(self, name: str, shared: bool) -> int:
        """The host bytes the placed value of the per-layer leaf `name` holds until it is
        written into its stacked leaf (0 for any other leaf): its blocks on this process's
        CPU devices (other devices' memory is not the host's). `shared`: the devices that
        hold the same block share one buffer (placed from one host array), counted once;
        else each device's own copy is counted."""
        hit = self.slice_of(name)
        if hit is None:
            return 0
        old = self.stacked_leaf(hit[0])
        shape, itemsize = tuple(old.shape[1:]), np.dtype(old.dtype).itemsize
        sharding = layer_sharding(self.sharding(hit[0]), len(old.shape))
        blocks = [
            tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
            for device, index in sharding.addressable_devices_indices_map(shape).items()
            if device.platform == "cpu"
        ]
        if shared:
            blocks = list(dict.fromkeys(blocks))
        return sum(math.prod(b - a for a, b in block) * itemsize for block in blocks)
