"""`Stack`: identical blocks held as one block with a leading layer axis, run by
``jax.lax.scan`` (compiled once, whatever the depth)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import wadler_lindig as wl

from ..module import Module, Rngs, field
from ..state import layer_slice
from ._sequential import _takes  # pyright: ignore[reportPrivateUsage]  (the package's own)

# What `Stack(remat=...)` takes: False (no rematerialisation), True (recompute every
# activation of a layer in the backward pass), or a `jax.checkpoint` policy (a function
# from `jax.checkpoint_policies`) that names what is saved.
Remat = bool | Callable[..., Any]


class Stack(Module):
    """``count`` identical blocks, held as one block whose every parameter has a leading
    layer axis of size ``count``, and called with ``jax.lax.scan``: ``jax.jit`` traces and
    compiles one block whatever the depth.

    Layer ``i`` is built by ``make_block(nn.Rngs(keys[i]))``, ``keys`` being
    ``jax.random.split(rngs(), count)``: each layer from its own key, all built at once by
    ``jax.vmap`` (no per-layer copy is made and stacked). ``stack[i]`` is layer ``i`` as a
    block of its own; ``len(stack)`` is ``count``.

    **Names.** The state of a stack at ``layers`` names its block ``layers.block``: its
    leaves read ``layers.block.attention.query.kernel``, shape ``[count, ...]``. The same
    leaves read per layer as ``layers.3.attention.query.kernel`` (the layer index in place
    of ``block``, as a list of blocks names them): ``taktiny.flat_state_dict(model,
    unstacked=True)`` gives those names, and every load (``load_flat_state_dict``,
    ``load_state_dict``, ``taktiny.io.load_safetensors``) takes either form, a per-layer
    name writing its layer's slice. So the rules that convert a Hugging Face checkpoint
    into a list of blocks (``model.layers.{i}...`` -> ``layers.{i}...``) load it into a
    stack too, streamed slice by slice into the stacked arrays.

    **Sharding.** The sharding rules of :func:`taktiny.shard` match the stacked names
    (``layers.*.attention.query.kernel`` matches both forms) and give the spec of one
    layer's array; the stack prepends its ``layer_axis`` for the layer axis (None: not
    split).

    Args:
        make_block: builds one block from a key stream (``lambda rngs: Block(config,
            rngs=rngs)``).
        count: how many layers.
        rngs: the key stream; one key is drawn for the whole stack.
        remat: False; True to recompute each layer's activations in the backward pass
            (``jax.checkpoint`` around the layer); or a ``jax.checkpoint`` policy
            (``jax.checkpoint_policies.dots_saveable``) naming what to keep.
        layer_axis: the mesh axis that splits the layer axis, or None (the default) to
            keep every layer on every device that holds the block's parameters.

    Attributes:
        block: the block; every array in it has the leading layer axis ``[count, ...]``.
        count: how many layers.
        remat: as given.
        layer_axis: as given.

    Raises:
        ValueError: `count` is not an int >= 1.
    """

    _taktiny_stacked = "block"  # the data field holding the stacked block (state/ reads it)

    block: Module
    count: int = field(static=True)
    remat: Remat = field(static=True, default=False)
    layer_axis: str | None = field(static=True, default=None)

    def __init__(
        self,
        make_block: Callable[[Rngs], Module],
        count: int,
        *,
        rngs: Rngs,
        remat: Remat = False,
        layer_axis: str | None = None,
    ):
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(
                f"nn.Stack: count is the number of layers, an int >= 1; got {count!r}."
            )
        keys = jax.random.split(rngs(), count)
        # one block per key, built together: vmap stacks every array it makes
        self.block = jax.vmap(lambda key: make_block(Rngs(key)), spmd_axis_name=layer_axis)(keys)
        self.count = count
        self.remat = remat
        self.layer_axis = layer_axis

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> Module:
        """Layer `index` as a block of its own (its arrays sliced: copies).

        Args:
            index: the layer, ``-count <= index < count``.

        Returns:
            The block of layer `index`, each array without the layer axis.

        Raises:
            IndexError: `index` is out of range.
        """
        if not -self.count <= index < self.count:
            raise IndexError(f"nn.Stack of {self.count} layers has no layer {index}.")
        return jax.tree.map(lambda x: layer_slice(x, index), self.block)

    def map(self, fn: Callable[[Module], Any]) -> Any:
        """``fn`` applied to every layer at once (``jax.vmap`` over the layer axis), its
        results stacked: ``stack.map(lambda layer: layer.attention.init_cache(batch,
        length))`` makes a stacked :class:`KVCache`, one per layer.

        Args:
            fn: a function of one layer (the block, its arrays without the layer axis).

        Returns:
            ``fn``'s result for every layer, each array with a leading ``[count, ...]``.
        """
        return jax.vmap(fn, spmd_axis_name=self.layer_axis)(self.block)

    def __call__(self, x: Any, *xs: Any, key: Any = None, **kwargs: Any) -> Any:
        """Runs the layers in order with ``jax.lax.scan``, each on the previous one's
        output: layer ``i`` is called ``block_i(x, *xs_i, **kwargs)``.

        Args:
            x: the first layer's input, carried from layer to layer (a hidden state
                ``[batch, length, features]``, or any PyTree the block returns again
                with the same shapes).
            *xs: per-layer inputs, PyTrees whose leaves have the leading layer axis
                ``[count, ...]``: layer ``i`` gets their slice ``i`` (a stacked
                :class:`KVCache`, per-layer masks).
            key: a PRNG key, split into one per layer and given as ``key=`` to the
                block (dropout); None gives none.
            **kwargs: given to every layer as they are (``causal=True``).

        Returns:
            What the block returns, with its per-layer outputs stacked: the last layer's
            output when the block returns its carry alone; ``(x, ys)`` when it returns a
            pair ``(x, y)``, ``ys`` the layers' ``y`` stacked ``[count, ...]`` (the
            caches the layers advanced).

        Raises:
            TypeError: the block returns something that is neither its carry (the
                structure of `x`) nor a pair whose first item is.
        """
        with jax.named_scope("Stack"):
            keys = None if key is None else jax.random.split(key, self.count)
            if keys is not None and not _takes(type(self.block), "key"):
                keys = None
            carried = jax.tree.structure(x)
            pair: list[bool] = []  # whether the block returns (carry, y): told as it traces

            def layer(carry: Any, sliced: Any) -> tuple[Any, Any]:
                block, layer_xs, layer_key = sliced
                extra = {} if layer_key is None else {"key": layer_key}
                out = block(carry, *layer_xs, **extra, **kwargs)
                if jax.tree.structure(out) == carried:
                    pair.append(False)
                    return out, None
                if isinstance(out, tuple) and len(out) == 2:  # pyright: ignore[reportUnknownArgumentType]
                    if jax.tree.structure(out[0]) == carried:
                        pair.append(True)
                        return out[0], out[1]
                raise TypeError(
                    f"nn.Stack: its block ({type(self.block).__name__}) returned "
                    f"{jax.tree.structure(out)}; a stacked block returns its carry (the "
                    f"structure of x: {carried}) or a pair (carry, y)."
                )

            if self.remat is not False:
                policy = None if self.remat is True else self.remat
                layer = jax.checkpoint(layer, policy=policy)
            x, ys = jax.lax.scan(layer, x, (self.block, xs, keys))
            return (x, ys) if pair[0] else x

    def __pdoc__(self, **kwargs: Any) -> wl.AbstractDoc:
        inner = wl.pdoc(self.block, **kwargs)
        extra = (
            "" if self.remat is False else f", remat={getattr(self.remat, '__name__', self.remat)}"
        )
        extra += "" if self.layer_axis is None else f", layer_axis={self.layer_axis!r}"
        return wl.ConcatDoc(wl.TextDoc(f"Stack({self.count} x "), inner, wl.TextDoc(f"{extra})"))
