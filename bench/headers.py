"""Opening a large header: ``taktiny.io.open_safetensors`` of a file of 100,000 tensors.

The file is written by the safetensors library (its header is 12 MB of JSON, in the
library's order), from small float32 tensors named as a mixture-of-experts model names its
weights (``model.layers.17.mlp.experts.42.down_proj.weight``). The time is the whole open:
reading the header, parsing it, every check of every entry (types, dtype, shape bounds,
byte counts, the ranges covering the data exactly, the metadata) and the `Tensor` handles;
the page cache is warm (the header's bytes are read from memory). Beside it, as
references: ``safetensors.safe_open`` listing its keys (the library's own parse and checks,
in Rust), and ``json.loads`` of the same header bytes alone (the floor of a parse in
Python). The target is 0.25 s.

Then the command a user types: the wall time of ``taktiny inspect`` on a small bfloat16
file, in a fresh process, against ``python -c "import numpy"`` and ``python -c "pass"`` (the
floors it starts from). The target is 0.2 s.

And ``taktiny diff`` of a model whose factory module builds on ``examples/llama.py`` (and so
imports transformers' ``LlamaForCausalLM``, and torch), against ``python -c`` importing that
module alone: what the command adds to the import a user's own Python makes. No target.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import safetensors
import safetensors.numpy

from . import memory
from ._results import Config, Group, Table, Target
from ._timing import compare

TARGET_S = 0.25
COMMAND_TARGET_S = 0.2
TT, LIBRARY, JSON = "Taktiny", "safetensors (Rust)", "json.loads alone"
PER_LAYER = 1_000  # tensors per layer: 250 experts of 4 weights


def _write(path: Path, count: int) -> None:
    """`count` tensors of 4 float32 each, named like a mixture of experts' weights."""
    weights = ("gate_proj", "up_proj", "down_proj", "router")
    value = np.zeros(4, np.float32)
    tensors = {
        f"model.layers.{i // PER_LAYER}.mlp.experts.{i % PER_LAYER // 4}.{weights[i % 4]}.weight": (
            value
        )
        for i in range(count)
    }
    safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})


def _json(path: Path) -> object:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def _library(path: Path) -> list[str]:
    with safetensors.safe_open(str(path), "np") as f:
        return list(f.keys())


def run(config: Config) -> Group:
    """Writes the file, then times the opens side by side."""
    from taktiny.io import open_safetensors

    start = time.perf_counter()
    count = config.pick(100_000, 100_000, 2_000)
    root = Path(config.scratch)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "headers.safetensors"
    try:
        _write(path, count)
        header_bytes = struct.unpack("<Q", path.read_bytes()[:8])[0]
        # (checked, then dropped: with the 100,000 tensors of a first open still alive,
        # every later open took half as long again, 0.29 s instead of 0.19 s, 2026-12-03)
        assert len(open_safetensors(path)) == count and len(_library(path)) == count
        stats = compare(
            {
                TT: lambda: open_safetensors(path),
                LIBRARY: lambda: _library(path),
                JSON: lambda: _json(path),
            },
            repeat=config.pick(11, 5, 1),
        )
    finally:
        path.unlink(missing_ok=True)
    group = Group("headers", f"Opening a header of {count:,} tensors")
    table = Table(
        f"open a safetensors file of {count:,} tensors ({header_bytes / 1e6:.1f} MB header)",
        [TT, LIBRARY, JSON],
    )
    op = f"open, {count:,} tensors"
    calls = {
        TT: "taktiny.io.open_safetensors(path)",
        LIBRARY: "list(safetensors.safe_open(path, 'np').keys())",
        JSON: "json.loads(header bytes)",
    }
    for system, call in calls.items():
        s = stats[system]
        table.add(op, system, call, s.median, (s.low, s.high))
    group.tables.append(table)
    median = stats[TT].median
    group.targets.append(
        Target(
            f"open_safetensors of a {count:,}-tensor header in <= {TARGET_S} s",
            median / TARGET_S,
            1.0,
            False,
            f"median time of the open / {TARGET_S} s",
        )
    )
    group.notes.append(
        f"Median {median * 1e3:.0f} ms = {median / TARGET_S:.2f}x the {TARGET_S} s target; "
        f"json.loads of the same bytes alone takes {stats[JSON].median * 1e3:.0f} ms and the "
        f"safetensors library's safe_open {stats[LIBRARY].median * 1e3:.0f} ms. Every entry is "
        f"checked (see taktiny/io/_header.py): a good header passes the checks in bulk. The "
        f"samples are timed with the cyclic garbage collector paused, as timeit times them; "
        f"in a program, where it runs, its collections of the parse's ~400,000 new dicts "
        f"and lists double the open to about 0.5 s (json.loads alone: 0.10 s paused, "
        f"0.26-0.30 s running). Taktiny does not pause it: that is a process-wide switch."
    )
    group.tables.append(_command(config, root, group))
    group.tables.append(_factory(config, root, group))
    group.seconds = time.perf_counter() - start
    return group


def _checkout() -> dict[str, str]:
    """The environment of a command that runs this checkout's taktiny (not the one an
    editable install of another checkout would import)."""
    path = os.pathsep.join([str(memory.ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def _command(config: Config, root: Path, group: Group) -> Table:
    """The wall time of `taktiny inspect` on a small bfloat16 file, in a fresh process."""
    import ml_dtypes

    path = root / "inspect.safetensors"
    tensors = {f"layers.{i}.kernel": np.zeros((64, 64), ml_dtypes.bfloat16) for i in range(8)}
    safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})
    command = shutil.which("taktiny", path=str(Path(sys.executable).parent))
    runs = {
        "taktiny inspect": [command or "taktiny", "inspect", str(path)],
        "python -c 'import numpy'": [sys.executable, "-c", "import numpy"],
        "python -c 'pass'": [sys.executable, "-c", "pass"],
    }
    run = lambda argv: subprocess.run(argv, check=True, capture_output=True, env=_checkout())
    try:
        stats = compare({k: (lambda a=a: run(a)) for k, a in runs.items()},
                        repeat=config.pick(11, 5, 1))  # fmt: skip
    finally:
        path.unlink(missing_ok=True)
    table = Table("the taktiny inspect command, wall time of a fresh process", list(runs))
    for system, argv in runs.items():
        s = stats[system]
        call = " ".join([Path(argv[0]).name, *argv[1:2]])
        table.add("8 bfloat16 tensors", system, call, s.median, (s.low, s.high))
    median = stats["taktiny inspect"].median
    group.targets.append(
        Target(
            f"taktiny inspect FILE.safetensors in <= {COMMAND_TARGET_S} s of wall time",
            median / COMMAND_TARGET_S,
            1.0,
            False,
            f"median wall time of the command / {COMMAND_TARGET_S} s",
        )
    )
    numpy, python = stats["python -c 'import numpy'"], stats["python -c 'pass'"]
    group.notes.append(
        f"taktiny inspect: median {median * 1e3:.0f} ms of wall time = "
        f"{median / COMMAND_TARGET_S:.2f}x the {COMMAND_TARGET_S} s target; a Python that "
        f"imports NumPy and nothing else takes {numpy.median * 1e3:.0f} ms, one that starts "
        f"and stops {python.median * 1e3:.0f} ms. The command imports neither JAX nor "
        f"ml_dtypes (a header names dtypes: taktiny/io/_dtypes.py), nor NumPy, which it "
        f"imports when a tensor is read (taktiny/_lazy.py)."
    )
    return table


ALONE = "python -c 'import llama_factory'"
FACTORY = """import sys
sys.path.insert(0, {examples!r})
from llama import Llama, llama_config  # (imports transformers' LlamaForCausalLM)
from taktiny import nn


def model():
    return Llama(llama_config(True), rngs=nn.Rngs(0))
"""
# the smoke test's module: the same command on a model whose module imports no transformers
# (tests/package/test_cli.py runs one that does; torch's import alone takes 20-50 s on 2 busy cores)
SMOKE_FACTORY = """from taktiny import nn


def model():
    return nn.Linear(4, 2, rngs=nn.Rngs(0))
"""


def _factory(config: Config, root: Path, group: Group) -> Table:
    """The wall time of `taktiny diff` of a model made by a factory module that imports
    transformers' model classes, in a fresh process, and of importing that module alone."""
    module = root / "llama_factory.py"
    source = config.pick(FACTORY, FACTORY, SMOKE_FACTORY)
    module.write_text(source.format(examples=str(Path(__file__).parent.parent / "examples")))
    command = shutil.which("taktiny", path=str(Path(sys.executable).parent)) or "taktiny"
    runs = {"taktiny diff": [command, "diff", "llama_factory:model", "llama_factory:model"]}
    if config.pick(True, True, False):  # (the smoke test runs the command only)
        runs[ALONE] = [sys.executable, "-c", "import llama_factory"]
    run = lambda argv: subprocess.run(
        argv, check=True, capture_output=True, cwd=root, env=_checkout()
    )
    try:  # (each sample takes 10-20 s, torch's import: three are enough for a median)
        stats = compare({k: (lambda a=a: run(a)) for k, a in runs.items()},
                        repeat=config.pick(3, 2, 1), warmup=0)  # fmt: skip
    finally:
        module.unlink(missing_ok=True)
        shutil.rmtree(root / "__pycache__", ignore_errors=True)
    table = Table(
        "taktiny diff of a model whose module imports transformers' LlamaForCausalLM, "
        "wall time of a fresh process",
        list(runs),
    )
    for system, argv in runs.items():
        s = stats[system]
        call = " ".join([Path(argv[0]).name, *argv[1:]])
        table.add("Llama of examples/llama.py", system, call, s.median, (s.low, s.high))
    alone = f"{stats[ALONE].median:.1f} s" if ALONE in stats else "not measured"
    group.notes.append(
        f"taktiny diff llama_factory:model llama_factory:model (a module that builds on "
        f"examples/llama.py, and so imports transformers' LlamaForCausalLM and torch): median "
        f"{stats['taktiny diff'].median:.1f} s of wall time; Python importing the module "
        f"alone {alone}. The command imports the module as Python does (it leaves no module "
        f"loaded lazily in sys.modules, where one broke SciPy's import inside transformers'). "
        f"No target."
    )
    return table
