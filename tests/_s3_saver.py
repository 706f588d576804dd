"""A process saving one checkpoint to object storage over and over, for the race and kill
tests (tests/io/test_object_store_races.py): run as

    python tests/_s3_saver.py URL SECONDS

it saves version 1, then 2, 1, 2, ... to URL (by turns one object, three shards, two
shards), for SECONDS seconds, a save every `EVERY` seconds (a training loop saves every few
minutes: a load must not have to outrun saves back to back), printing each version once it
is committed. Each version's tensors say which they are (`version`)."""

from __future__ import annotations

import sys
import time

import numpy as np

LAYOUTS = (None, "150KB", "300KB")  # one object, three shards, two shards
EVERY = 0.5


def version(number: int) -> dict[str, np.ndarray]:
    """The tensors of version `number` (~600 KB): different bytes for each number."""
    rng = np.random.default_rng(number)
    return {
        "embed": rng.standard_normal((128, 512), np.float32),
        "head.kernel": rng.standard_normal((256, 128), np.float32),
        "head.bias": np.full((128,), number, np.float32),
    }


def main() -> None:
    from taktiny.io import save_safetensors

    url, seconds = sys.argv[1], float(sys.argv[2])
    deadline = time.monotonic() + seconds
    turn = 0
    while time.monotonic() < deadline:
        started = time.monotonic()
        number = 1 + turn % 2
        save_safetensors(url, version(number), max_shard_size=LAYOUTS[turn % len(LAYOUTS)])
        print(number, flush=True)
        turn += 1
        time.sleep(max(0.0, started + EVERY - time.monotonic()))


if __name__ == "__main__":
    main()
