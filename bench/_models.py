"""The "many small blocks" architecture, written once per system.

Each block holds two ``Linear(16, 16)`` layers and a pair of ``[16]`` arrays: six
leaves, so 64 blocks make the 384-leaf model and 500 blocks the 3,000-leaf one.
Every system builds exactly this tree, with the same parameter names where it can
(PyTorch calls a kernel ``weight`` and stores it transposed).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import torch
from flax import nnx

from taktiny import nn

WIDTH = 16
LEAVES_PER_BLOCK = 6


class TaktinyBlock(nn.Module):
    def __init__(self, *, rngs: nn.Rngs):
        self.a = nn.Linear(WIDTH, WIDTH, rngs=rngs)
        self.b = nn.Linear(WIDTH, WIDTH, rngs=rngs)
        self.scale = jnp.ones((WIDTH,))
        self.shift = jnp.zeros((WIDTH,))


class TaktinyBlocks(nn.Module):
    def __init__(self, n: int, *, rngs: nn.Rngs):
        self.blocks = [TaktinyBlock(rngs=rngs) for _ in range(n)]


class NNXBlock(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.a = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.b = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.scale = nnx.Param(jnp.ones((WIDTH,)))
        self.shift = nnx.Param(jnp.zeros((WIDTH,)))


class NNXBlocks(nnx.Module):
    def __init__(self, n: int, *, rngs: nnx.Rngs):
        self.blocks = nnx.List([NNXBlock(rngs=rngs) for _ in range(n)])


class EqxBlock(eqx.Module):
    a: eqx.nn.Linear
    b: eqx.nn.Linear
    scale: jax.Array
    shift: jax.Array

    def __init__(self, key: jax.Array):
        ka, kb = jax.random.split(key)
        self.a = eqx.nn.Linear(WIDTH, WIDTH, key=ka)
        self.b = eqx.nn.Linear(WIDTH, WIDTH, key=kb)
        self.scale = jnp.ones((WIDTH,))
        self.shift = jnp.zeros((WIDTH,))


class EqxBlocks(eqx.Module):
    blocks: list[EqxBlock]

    def __init__(self, n: int, seed: int):
        self.blocks = [EqxBlock(k) for k in jax.random.split(jax.random.key(seed), n)]


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(WIDTH, WIDTH)
        self.b = torch.nn.Linear(WIDTH, WIDTH)
        self.scale = torch.nn.Parameter(torch.ones(WIDTH))
        self.shift = torch.nn.Parameter(torch.zeros(WIDTH))


class TorchBlocks(torch.nn.Module):
    def __init__(self, n: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = torch.nn.ModuleList([TorchBlock() for _ in range(n)])


def build(system: str, n: int, seed: int):
    """The `n`-block model of `system` ("taktiny", "nnx", "equinox" or "torch")."""
    if system == "taktiny":
        return TaktinyBlocks(n, rngs=nn.Rngs(seed))
    if system == "nnx":
        return NNXBlocks(n, rngs=nnx.Rngs(seed))
    if system == "equinox":
        return EqxBlocks(n, seed)
    if system == "torch":
        return TorchBlocks(n, seed)
    raise ValueError(f"unknown system {system!r}")
