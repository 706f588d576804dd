"""Models that change over state versions, shared by the tests of migrations and of load
plans.

An attention block over three versions (version 2 renamed its MLP and fused q, k, v into
one projection; version 3 added a gate), and a network of blocks whose *nested* class
changes: ``Block`` is at version 2 (it renamed its MLP, stores its query kernel
transposed and added a gate) inside ``Net``, which declares no version of its own, and
inside ``NetV2``, which is at version 2 itself (it renamed its head and added a norm).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from taktiny import convert, nn

# version 1 -> 2: the MLP is renamed to "ffn", and q, k, v are fused into one projection
TO_2: list[Any] = [
    convert.Rule("mlp.{p}", "ffn.{p}"),
    convert.Rule(["q.kernel", "k.kernel", "v.kernel"], "qkv.kernel", convert.concatenate(axis=1)),
]
# version 2 -> 3: a gate is added, initialised by the model
TO_3: list[Any] = [convert.Init("gate.kernel")]


class BlockV1(nn.Module):
    def __init__(self, *, rngs: nn.Rngs):
        self.q = nn.Linear(8, 8, use_bias=False, rngs=rngs)
        self.k = nn.Linear(8, 8, use_bias=False, rngs=rngs)
        self.v = nn.Linear(8, 8, use_bias=False, rngs=rngs)
        self.mlp = nn.Linear(8, 8, rngs=rngs)


class BlockV2(nn.Module):
    state_version: ClassVar[int] = 2
    state_migrations: ClassVar[Sequence[Sequence[Any]]] = (TO_2,)

    def __init__(self, *, rngs: nn.Rngs):
        self.qkv = nn.Linear(8, 24, use_bias=False, rngs=rngs)
        self.ffn = nn.Linear(8, 8, rngs=rngs)


class BlockV3(nn.Module):
    state_version: ClassVar[int] = 3
    state_migrations: ClassVar[Sequence[Sequence[Any]]] = (TO_2, TO_3)

    def __init__(self, *, rngs: nn.Rngs):
        self.qkv = nn.Linear(8, 24, use_bias=False, rngs=rngs)
        self.ffn = nn.Linear(8, 8, rngs=rngs)
        self.gate = nn.Linear(8, 8, use_bias=False, rngs=rngs)


class InnerV1(nn.Module):
    """Version 1 of the nested block."""

    def __init__(self, *, rngs: nn.Rngs):
        self.mlp = nn.Linear(8, 16, rngs=rngs)
        self.q = nn.Linear(8, 8, use_bias=False, rngs=rngs)


class Inner(nn.Module):
    """Version 2: the MLP renamed "ffn", the query kernel stored transposed, a gate added.
    Its rules name its own leaves; a model holding it applies them under its path."""

    state_version: ClassVar[int] = 2
    state_migrations: ClassVar[Sequence[Sequence[Any]]] = (
        [
            convert.Rule("mlp.{p}", "ffn.{p}"),
            convert.Rule("q.kernel", "q_t", convert.transpose((1, 0))),
            convert.Init("gate.kernel"),
        ],
    )

    def __init__(self, *, rngs: nn.Rngs):
        self.ffn = nn.Linear(8, 16, rngs=rngs)
        self.q_t = jax.random.normal(rngs(), (8, 8))
        self.gate = nn.Linear(8, 8, use_bias=False, rngs=rngs)


class NetV1(nn.Module):
    def __init__(self, *, rngs: nn.Rngs, depth: int = 3):
        self.blocks = [InnerV1(rngs=rngs) for _ in range(depth)]
        self.head = nn.Linear(8, 4, rngs=rngs)


class Net(nn.Module):
    """No version of its own; its blocks have theirs."""

    def __init__(self, *, rngs: nn.Rngs, depth: int = 3):
        self.blocks = [Inner(rngs=rngs) for _ in range(depth)]
        self.head = nn.Linear(8, 4, rngs=rngs)


class NetV2(nn.Module):
    """A version of its own too: the head renamed "out", a norm scale added."""

    state_version: ClassVar[int] = 2
    state_migrations: ClassVar[Sequence[Sequence[Any]]] = (
        [convert.Rule("head.{p}", "out.{p}"), convert.Init("norm")],
    )

    def __init__(self, *, rngs: nn.Rngs, depth: int = 3):
        self.blocks = [Inner(rngs=rngs) for _ in range(depth)]
        self.out = nn.Linear(8, 4, rngs=rngs)
        self.norm = jnp.ones(8) + jax.random.normal(rngs(), (8,))
