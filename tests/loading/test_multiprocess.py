"""Multi-process (multi-host) training and checkpointing, with 2 local processes of 4 simulated
CPU devices each (8 global devices) running examples/distributed.py: one pair trains a model
sharded over all 8 a step and saves model and optimizer state with Orbax to a shared
directory; a second pair restores both onto a mesh of another shape, each process comparing
the shards it holds, bit for bit, with what the saving processes held. And loads streamed
from safetensors: each process reading its own devices' bytes, and a per-layer checkpoint
into a sharded stack of layers."""

import sys

import ml_dtypes
import numpy as np
import pytest
from _processes import ROOT, lines, run_processes

from taktiny.io import open_safetensors, save_safetensors

pytestmark = pytest.mark.program


def test_two_processes_save_and_restore_onto_another_mesh_bitwise(tmp_path):
    (tmp_path / "run").mkdir()
    saved = run_processes(tmp_path, "save", "2,4")
    for i, out in enumerate(saved):
        assert lines(out, "devices") == [f"process {i} of 2: 4 of 8 devices"], out
    losses = {lines(out, "step 0 loss")[0].split(": ", 1)[1] for out in saved}
    assert len(losses) == 1, losses  # one global loss, whichever process reads it
    written = sorted(p.name for p in (tmp_path / "run" / "checkpoint").iterdir())
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(written), written

    restored = run_processes(tmp_path, "restore", "4,2")
    for i, out in enumerate(restored):
        # 5 parameters, adam's count and 5 + 5 moments; each process compares its 4 devices'
        mesh = "on mesh {'data': 4, 'model': 2}"
        assert lines(out, "bitwise") == [  # then the weights streamed from safetensors
            f"process {i}: 16 leaves restored bitwise equal (64 shards) {mesh}",
            f"process {i}: 5 leaves restored bitwise equal (20 shards) {mesh}",
        ], out
        assert len(lines(out, "step 1 loss")) == 1, out  # and training resumes


def test_each_process_reads_only_the_bytes_of_its_own_devices(tmp_path):
    """A model split on every tensor over the 8 devices of 2 processes: each process reads
    only its half of each tensor (inner and middle axis splits too), and its shards are
    bitwise the file's. Verified too: each checks the digests of the tiles it reads, so
    only a tensor too small for tiles (the bias, 256 bytes) is also read whole."""
    rng = np.random.default_rng(0)
    values = {  # each split as bench/_process_load.py splits it: by its name and rank
        "outer": rng.standard_normal((512, 64), np.float32),  # tiles (2, 1)
        "inner": rng.standard_normal((64, 2048), np.float32),  # tiles (4, 2)
        "cube": rng.standard_normal((1, 256, 512), np.float32).astype(ml_dtypes.bfloat16),
        "bias": rng.standard_normal((64,), np.float32),  # one tile: read whole, verified
    }
    path = tmp_path / "weights.safetensors"
    save_safetensors(path, values)
    assert {n: t.tiles and t.tiles[0] for n, t in open_safetensors(path).items()} == {
        "outer": (2, 1),
        "inner": (4, 2),
        "cube": (1, 2, 2),  # the middle axis cut in two
        "bias": None,
    }
    total = sum(v.nbytes for v in values.values())
    # the header too, read once through the file's storage, like every other byte
    header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    half = total // 2 + header
    verified = half + values["bias"].nbytes  # the bias read whole to hash it, too
    assert verified <= 0.55 * total
    program = [str(ROOT / "bench" / "_process_load.py"), str(path)]
    outputs = run_processes(tmp_path, "load", "8", program=program)
    for i, out in enumerate(outputs):
        read = [line.split(" in ")[0] for line in lines(out, "bitwise")]
        assert read == [  # each reads its half
            f"process {i}: read {half} of {total} bytes (verify=False)",
            f"process {i}: read {verified} of {total} bytes (verify=True)",
        ], out
        assert [line.split("; ")[1] for line in lines(out, "bitwise")] == [
            "16 shards bitwise equal"  # 4 devices x 4 tensors, each of its own block
        ] * 2, out


def test_two_processes_stream_a_per_layer_checkpoint_into_a_sharded_stack(tmp_path):
    """Hugging Face names, each layer's weight transposed on its way into its slice of the
    stacked kernel, split by columns over 'model' across both processes, and with the layers
    themselves split over 'data' (each process holding two of the four): every shard each
    process holds is bitwise the exported model's (tests/_stack_process.py)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from _stack_process import RULES, SPLITS, model

    from taktiny import convert

    path = tmp_path / "layers.safetensors"
    save_safetensors(path, convert.export(RULES, model()))
    assert "model.layers.3.proj.weight" in open_safetensors(path)
    program = [str(ROOT / "tests" / "_stack_process.py"), str(path)]
    outputs = run_processes(tmp_path, "stack", "8", program=program)
    for i, out in enumerate(outputs):
        # 3 leaves, each on 4 devices of the process: its shards, whatever the split
        assert lines(out, "bitwise") == [
            f"process {i}: {case}: 3 leaves' 12 shards bitwise equal" for case in SPLITS
        ], out
