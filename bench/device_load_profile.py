"""Where a staged load's reader threads spend their time (issue 52 point 3; FINDINGS 14):
a 1 GiB bfloat16 file loaded onto the default device, warm, with the staging functions
wrapped in timers; prints GiB/s and the seconds summed over the reader threads (the read
and hash of each piece without the wait for a ring buffer, that wait, `device_put`, and the
dispatch of the jitted write into place, a unit's whole read, the leaf begun as zeros),
the load's own thread (waiting for each unit in turn, placing it), and the readers'
width after each unit, checksums verified and not.

    python bench/device_load_profile.py FOLDER     # on an accelerator's host
"""

import collections
import sys
import threading
import time
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

import taktiny.io._read as R
import taktiny.loading._load as L
import taktiny.loading._readers as readers_module
import taktiny.loading._ways as W
from taktiny.io import load_safetensors, save_safetensors

spent = collections.Counter()
lock = threading.Lock()


def timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            with lock:
                spent[name] += time.perf_counter() - t

    return wrapper


def timed_iter(name, fn):
    def wrapper(*a, **k):
        it = fn(*a, **k)
        while True:
            t = time.perf_counter()
            try:
                x = next(it)
            except StopIteration:
                return
            finally:
                with lock:
                    spent[name] += time.perf_counter() - t
            yield x

    return wrapper


folder = Path(sys.argv[1])
folder.mkdir(exist_ok=True)
path = folder / "p.safetensors"
rng = np.random.default_rng(0)
state = {
    f"w{i}": (rng.integers(0, 2**16, (4096, 4096), dtype=np.uint16) & 0x7F7F).view(
        ml_dtypes.bfloat16
    )
    for i in range(32)
}
save_safetensors(path, state)
path.read_bytes()
target = {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in state.items()}
jax.block_until_ready(load_safetensors(target, path, progress=False))  # warm: compiles
W.placed = timed("device_put", W.placed)
W.Staged.read = timed("a unit's read, whole (reader)", W.Staged.read)
W.Staged.place = timed("placing a unit (load's thread)", W.Staged.place)
real_zeros = W.zeros_on
W.zeros_on = lambda *a: timed("the leaf begun (zeros)", real_zeros(*a))
L.result_of = timed("waiting for a unit (load's thread)", L.result_of)
widths = []
real_finished = readers_module.Readers.finished


def finished(self, nbytes):
    real_finished(self, nbytes)
    widths.append(self.width)


readers_module.Readers.finished = finished
W.Ring.take = timed("ring.take (wait)", W.Ring.take)
R.Tensor.read_rows = timed_iter("read+hash a piece", R.Tensor.read_rows)
real_writer = W._writer
W._writer = lambda perm, sharding: timed("write into place (dispatch)", real_writer(perm, sharding))
for verify in (True, False):
    spent.clear()
    t = time.perf_counter()
    jax.block_until_ready(load_safetensors(target, path, verify=verify, progress=False))
    wall = time.perf_counter() - t
    waits = spent["ring.take (wait)"]
    spent["read+hash a piece"] -= waits
    print(
        f"verify={verify}: {1 / wall:.2f} GiB/s, wall {wall:.3f} s; thread-seconds:",
        {k: round(v, 3) for k, v in spent.items()},
        "readers' width after each unit:",
        widths,
    )
    widths.clear()
