"""What an accelerator's host can feed its device, by the shape of the pipeline (issue 52
point 3; bench/FINDINGS.md section 14): ``jax.device_put`` of host arrays from 1, 4 or 8
threads, in pieces of 8 or 32 MiB; the file read into reused buffers (two a thread) and
each piece copied as it is read, at 4, 8 and 12 threads, hashed or not; ``jax.device_put``
straight from the file's mapped pages, populated three ways, hashed or not; XXH3-128
alone. A 1 GiB bfloat16 file (``P_LAYERS`` x ``P_WIDTH`` squares: 32 x 4096) in the page
cache. Prints GiB/s by name (median of 3 each, one run).

``steps`` (alone: ``python bench/device_pipelines.py FOLDER steps``) asks what a step of
an FP8 load costs beyond its copy (FINDINGS 14: such loads reach 0.7-0.8x their file's
raw pipeline, the plain load 1.1x): half the file's mapped pages, copied onto the device
by 8 threads in steps of one layer's bytes as FP8 weights (``P_WIDTH`` squared), each
hashed and copied as the loader does, and then, each alone and together: a second copy
of a few KiB (the step's scales), a program making the step's bfloat16 product from them
(its result twice the weights' bytes on the device), and the results let go before the
next round or kept. GiB/s of the weights' bytes.

    python bench/device_pipelines.py FOLDER [steps]    # on the accelerator's host
"""

from __future__ import annotations

import json
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import xxhash

GiB, MiB = 2**30, 2**20
LAYERS = int(os.environ.get("P_LAYERS", "32"))
WIDTH = int(os.environ.get("P_WIDTH", "4096"))


def _timed(size: int, fn: Callable[[], Any]) -> float:
    """GiB/s of `size` bytes moved by `fn` (median of 3 calls)."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(size / GiB / statistics.median(times), 2)


def _pieces(size: int, piece: int) -> list[tuple[int, int]]:
    return [(offset, min(piece, size - offset)) for offset in range(0, size, piece)]


def _threads(count: int, work: Callable[[int], Any]) -> list[Any]:
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(work, range(count)))


def put_pieces(flat: np.ndarray, device: Any, threads: int, piece: int) -> None:
    """`flat` (bfloat16) copied onto `device` in pieces of `piece` bytes by `threads`."""
    views = [flat[o // 2 : (o + n) // 2] for o, n in _pieces(flat.nbytes, piece)]
    jax.block_until_ready(
        _threads(threads, lambda k: [jax.device_put(v, device) for v in views[k::threads]])
    )


def read_put(fd: int, size: int, device: Any, threads: int, piece: int, hashed: bool) -> None:
    """The file read `piece` bytes at a time by `threads` threads, each into two reused
    buffers in turns (a buffer read into again once its copy is done), each piece copied
    onto `device` as soon as it is read (`hashed`: after it is hashed)."""
    buffers = [[np.ones(piece, np.uint8) for _ in range(2)] for _ in range(threads)]

    def work(k: int) -> None:
        copies: list[Any] = [None, None]
        for i, (offset, n) in enumerate(_pieces(size, piece)[k::threads]):
            if copies[i % 2] is not None:
                copies[i % 2].block_until_ready()
            view, got = memoryview(buffers[k][i % 2])[:n], 0
            while got < n:
                got += os.preadv(fd, [view[got:]], offset + got)
            if hashed:
                xxhash.xxh3_128(view).digest()
            copies[i % 2] = jax.device_put(buffers[k][i % 2][:n].view(ml_dtypes.bfloat16), device)
        jax.block_until_ready(copies)

    _threads(threads, work)


def mapped_put(fd: int, size: int, device: Any, threads: int, hashed: bool, how: str) -> None:
    """`jax.device_put` of the file's mapped pages, 8 MiB at a time by `threads` threads
    (`hashed`: each piece hashed first), the mapping populated by `how`: ``"none"``
    (faulted as read), ``"flag"`` (``MAP_POPULATE``) or ``"madvise"`` (each piece
    ``MADV_POPULATE_READ`` before it is copied)."""
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if how == "flag" else 0)
    mapping = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
    pages = np.frombuffer(mapping, np.uint8)
    advice = getattr(mmap, "MADV_POPULATE_READ", mmap.MADV_WILLNEED)

    def work(k: int) -> list[Any]:
        copies = []
        for offset, n in _pieces(size, 8 * MiB)[k::threads]:
            if how == "madvise":
                mapping.madvise(advice, offset, n)
            if hashed:
                xxhash.xxh3_128(pages[offset : offset + n]).digest()
            copies.append(
                jax.device_put(pages[offset : offset + n].view(ml_dtypes.bfloat16), device)
            )
        return copies

    jax.block_until_ready(_threads(threads, work))


def fp8_steps(
    pages: np.ndarray, device: Any, threads: int, scales: bool, program: bool
) -> list[Any]:
    """The steps of an FP8 load over `pages` (mapped; one step a layer's ``WIDTH`` squared
    bytes), by `threads`: each hashed and copied onto `device`; with `scales`, a second
    copy of its block scales (one float32 a 128 x 128 block); with `program`, the
    bfloat16 product made on the device. The arrays made (kept by the caller, or not)."""
    step, blocks = WIDTH * WIDTH, max(WIDTH // 128, 1)
    scale = np.ones((blocks, blocks), np.float32)
    layers = [(o, step) for o in range(0, pages.size - step + 1, step)]

    def work(k: int) -> list[Any]:
        made = []
        for offset, n in layers[k::threads]:
            xxhash.xxh3_128(pages[offset : offset + n]).digest()
            weights = jax.device_put(pages[offset : offset + n].reshape(WIDTH, WIDTH), device)
            blocks_scale = jax.device_put(scale, device) if scales else None
            made.append(_product(weights, blocks_scale) if program else weights)
        return made

    return jax.block_until_ready(_threads(threads, work))


@jax.jit
def _product(weights: Any, scale: Any) -> Any:
    """The FP8 weights (as bytes) by their block scales (None: ones), in bfloat16."""
    values = jax.lax.bitcast_convert_type(weights, ml_dtypes.float8_e4m3fn).astype(np.float32)
    if scale is not None:
        size = weights.shape[0] // scale.shape[0]
        values = values * jax.numpy.repeat(jax.numpy.repeat(scale, size, 0), size, 1)
    return values.astype(ml_dtypes.bfloat16)


def steps(fd: int, size: int, device: Any) -> dict[str, Any]:
    """The ``steps`` figures (see the module's doc): GiB/s of the FP8 weights' bytes."""
    half = size // 2
    pages = np.frombuffer(mmap.mmap(fd, half, access=mmap.ACCESS_READ), np.uint8)
    out: dict[str, Any] = {}
    for name, scales, program in [
        ("weights", False, False),
        ("with_scales", True, False),
        ("with_program", False, True),
        ("with_scales_and_program", True, True),
    ]:
        run = lambda s=scales, p=program: fp8_steps(pages, device, 8, s, p)
        run()  # (compiles)
        out[f"steps_{name}"] = _timed(half, run)
        kept: list[Any] = []  # (each round's results held: none let go between rounds)
        out[f"steps_{name}_kept"] = _timed(half, lambda r=run, k=kept: k.append(r()))
    return out


def main(folder: Path, only: str | None = None) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    flat = (rng.integers(0, 2**16, LAYERS * WIDTH * WIDTH, dtype=np.uint16) & 0x7F7F).view(
        ml_dtypes.bfloat16
    )
    path = folder / "raw.bin"
    path.write_bytes(flat.tobytes())
    path.read_bytes()  # (in the page cache)
    size, device = flat.nbytes, jax.devices()[0]
    out: dict[str, Any] = {"device": device.device_kind}
    if only == "steps":
        fd = os.open(path, os.O_RDONLY)
        try:
            return out | steps(fd, size, device)
        finally:
            os.close(fd)
    for piece in (8 * MiB, 32 * MiB):
        for threads in (1, 4, 8):
            name = f"put_{piece // MiB}MiB_{threads}threads"
            out[name] = _timed(size, lambda t=threads, p=piece: put_pieces(flat, device, t, p))
    fd = os.open(path, os.O_RDONLY)
    for threads in (4, 8, 12):
        for piece in (8 * MiB, 32 * MiB):
            run = lambda t=threads, p=piece: read_put(fd, size, device, t, p, False)
            out[f"read_put_{threads}t_{piece // MiB}MiB"] = _timed(size, run)
        run = lambda t=threads: read_put(fd, size, device, t, 8 * MiB, True)
        out[f"read_hash_put_{threads}t_8MiB"] = _timed(size, run)
    for how in ("none", "flag", "madvise"):
        for threads in (4, 8):
            run = lambda t=threads, h=how: mapped_put(fd, size, device, t, False, h)
            out[f"mapped_put_{threads}t_{how}"] = _timed(size, run)
        run = lambda h=how: mapped_put(fd, size, device, 8, True, h)
        out[f"mapped_hash_put_8t_{how}"] = _timed(size, run)
    out |= steps(fd, size, device)
    os.close(fd)
    raw = flat.view(np.uint8)
    for threads in (1, 8):
        work = lambda k, t=threads: [
            xxhash.xxh3_128(raw[o : o + n]).digest() for o, n in _pieces(size, 8 * MiB)[k::t]
        ]
        out[f"hash_{threads}t"] = _timed(size, lambda t=threads, w=work: _threads(t, w))
    return out


if __name__ == "__main__":
    here = Path(sys.argv[1])
    here.mkdir(parents=True, exist_ok=True)
    print(json.dumps(main(here, *sys.argv[2:3]), indent=1))
