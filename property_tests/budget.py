"""How many examples each property runs.

Each property states its count for Hypothesis's standard ``max_examples=100``, and the count
scales with the active profile's ``max_examples``: the ``ci`` profile (100) runs the stated
counts, ``thorough`` (1000) ten times as many, ``accelerator`` (50) half as many. The counts
are sized so that the whole suite runs in about two minutes with ``-n 2`` on two cores.
"""

from hypothesis import settings


def examples(count: int) -> int:
    """`count` examples scaled by the active profile (at least one)."""
    return max(1, count * settings().max_examples // 100)
