"""`taktiny inspect` and `taktiny diff` on safetensors files, indexes and Orbax checkpoints."""

import json
import re
import subprocess
import sys
import weakref
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy
from _child import cpu_environment

from taktiny import _cli, nn
from taktiny._cli import main

ROOT = Path(__file__).resolve().parents[2]


def refused(capsys, argv, message):
    """`taktiny *argv` exits with 2 (as diff(1) does on trouble) after one line on stderr,
    ``taktiny: ...`` matching `message`, and prints nothing else."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("taktiny: "), err
    assert re.search(message, err), err
    assert "Traceback" not in err


def save(path, tensors):
    safetensors.numpy.save_file(tensors, str(path))
    return str(path)


@pytest.fixture
def two(tmp_path):
    a = save(tmp_path / "a.safetensors", {
        "encoder.kernel": np.ones((2, 3), np.float32),
        "encoder.bias": np.zeros(4, ml_dtypes.bfloat16),
        "head.kernel": np.arange(6, dtype=np.int8).reshape(3, 2),
    })  # fmt: skip
    b = save(tmp_path / "b.safetensors", {
        "encoder.kernel": np.full((2, 3), 1.5, np.float32),
        "encoder.bias": np.zeros(5, ml_dtypes.bfloat16),
        "head.kernel": np.arange(6, dtype=np.int8).reshape(3, 2),
        "extra": np.zeros(1, np.float32),
    })  # fmt: skip
    return a, b


def test_inspect_lists_names_shapes_dtypes_and_sizes(two, capsys):
    assert main(["inspect", two[0]]) == 0
    assert capsys.readouterr().out == (
        "name            shape   dtype     bytes\n"
        "encoder.bias    (4,)    bfloat16      8\n"
        "encoder.kernel  (2, 3)  float32      24\n"
        "head.kernel     (3, 2)  int8          6\n"
        "3 tensors, 16 parameters, 38 bytes\n"
    )
    assert main(["inspect", two[0], "--filter", "encoder.*", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in listed["tensors"]] == ["encoder.bias", "encoder.kernel"]
    assert listed["tensors"][1] == {"name": "encoder.kernel", "shape": [2, 3], "dtype": "float32",
                                    "bytes": 24}  # fmt: skip
    assert (listed["parameters"], listed["bytes"]) == (10, 32)


def test_inspect_shows_a_stack_s_layer_axis(tmp_path, capsys):
    from taktiny.io import save_safetensors

    stack = nn.Stack(lambda rngs: nn.Linear(2, 3, rngs=rngs), 4, rngs=nn.Rngs(0))
    save_safetensors(tmp_path / "stack.safetensors", {"head": nn.Linear(3, 1, rngs=nn.Rngs(1)),
                                                      "layers": stack})  # fmt: skip
    assert main(["inspect", str(tmp_path / "stack.safetensors")]) == 0
    assert capsys.readouterr().out == (
        "name                 shape      dtype    layers                  bytes\n"
        "head.bias            (1,)       float32                              4\n"
        "head.kernel          (3, 1)     float32                             12\n"
        "layers.block.bias    (4, 3)     float32  4 of 'layers' (axis 0)     48\n"
        "layers.block.kernel  (4, 2, 3)  float32  4 of 'layers' (axis 0)     96\n"
        "4 tensors, 40 parameters, 160 bytes\n"
    )
    assert main(["inspect", str(tmp_path / "stack.safetensors"), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["tensors"]
    assert listed[3]["stack"] == {"path": "layers", "count": 4} and "stack" not in listed[0]


def test_inspect_shows_the_scheme_of_fp8_and_compressed_tensors_checkpoints(tmp_path, capsys):
    from _quantized_files import fp8_folder

    import taktiny as tt
    from taktiny import convert

    weights = {
        "layers.0.weight": np.ones((200, 300), np.float32),
        "norm.weight": np.ones(8, np.float32),
    }
    fp8_folder(weights, tmp_path / "fp8", quantized=lambda n: n.startswith("layers"))
    assert main(["inspect", str(tmp_path / "fp8")]) == 0
    out = capsys.readouterr().out
    assert "layers.0.weight_scale_inv  (2, 3)      float32" in out
    assert out.endswith(
        "\nquantization: fp8, float8_e4m3fn weights in blocks of 128x128, each with its scales (*.weight_scale_inv): 1 weights (config.json)\n"
    )
    (tmp_path / "fp8" / "config.json").unlink()  # from the names alone
    assert main(["inspect", str(tmp_path / "fp8"), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["quantization"]
    assert listed == {
        "method": "fp8",
        "block_size": None,
        "weights": 1,
        "text": "fp8, float8_e4m3fn weights in blocks of ?x?, each with its scales (*.weight_scale_inv): 1 weights (from the tensors' names; no config.json)",
    }

    model = tt.quantize(nn.Sequential(nn.Linear(64, 32, rngs=nn.Rngs(0))), bits=4, group_size=16)
    tensors, config = convert.export_compressed_tensors(convert.linear("0", "layers.0"), model)
    (tmp_path / "ct").mkdir()
    save(tmp_path / "ct" / "model.safetensors", {n: np.asarray(a) for n, a in tensors.items()})
    (tmp_path / "ct" / "config.json").write_text(json.dumps({"quantization_config": config}))
    assert main(["inspect", str(tmp_path / "ct"), "--filter", "*.weight_*"]) == 0
    out = capsys.readouterr().out
    assert "0.bias" not in out and "0.weight_packed  (32, 8)  int32" in out
    assert out.endswith(
        "quantization: compressed-tensors pack-quantized (group_0: int4 in groups of 16): 1 packed weights (config.json)\n"
    )


def test_inspect_reads_an_index_and_its_shards(tmp_path, capsys):
    save(tmp_path / "model-00001-of-00002.safetensors", {"a": np.ones(3, np.float32)})
    save(tmp_path / "model-00002-of-00002.safetensors", {"b": np.ones((2, 2), np.float16)})
    index = {"metadata": {"total_size": 20}, "weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}  # fmt: skip
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    for where in (tmp_path, tmp_path / "model.safetensors.index.json"):
        assert main(["inspect", str(where), "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)
        assert {t["name"]: t["shape"] for t in listed["tensors"]} == {"a": [3], "b": [2, 2]}
        assert listed["bytes"] == 20
    index["weight_map"]["c"] = "../elsewhere.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(capsys, ["inspect", str(tmp_path)], r"index.json: the shard "
            r"'\.\./elsewhere\.safetensors' of 'c' is outside the index's folder")  # fmt: skip
    index["weight_map"]["c"] = "model-00003-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(capsys, ["inspect", str(tmp_path)],
            r"the shard 'model-00003-of-00002.safetensors' \(of 'c'\) is missing")  # fmt: skip


def test_inspect_reads_an_orbax_checkpoint_from_its_metadata(tmp_path, capsys):
    path = (tmp_path / "ckpt").absolute()
    model = nn.Linear(3, 4, rngs=nn.Rngs(0))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, {"model": model.state_dict()})
    assert main(["inspect", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "model.bias    (4,)    float32     16",
        "model.kernel  (3, 4)  float32     48",
        "2 tensors, 16 parameters, 64 bytes",
    ]


def test_bad_checkpoints_are_clear_errors(tmp_path, capsys):
    refused(capsys, ["inspect", str(tmp_path / "none.safetensors")], r"does not exist")
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    refused(capsys, ["inspect", str(broken)],
            r"broken.safetensors: not a safetensors file: its first")  # fmt: skip
    refused(capsys, ["diff", str(broken), str(broken)], r"broken.safetensors: not a safetensors")
    (tmp_path / "empty").mkdir()
    refused(capsys, ["inspect", str(tmp_path / "empty")],
            r"holds no Orbax checkpoint and no safetensors file or index")  # fmt: skip


def test_diff_reports_names_in_one_only_shape_changes_and_the_largest_difference(two, capsys):
    assert main(["diff", two[0], two[1]]) == 1
    assert capsys.readouterr().out == (
        f"only in {two[1]}: extra\n"
        "name            shape         dtype     max |a - b|  max |a - b| / |b|\n"
        "encoder.bias    (4,) vs (5,)  bfloat16            -                  -\n"
        "encoder.kernel  (2, 3)        float32           0.5           0.333333\n"
        "3 common tensors, 2 differ, 1 in one only\n"
    )
    assert main(["diff", two[0], two[0]]) == 0
    assert capsys.readouterr().out == "3 common tensors, 0 differ, 0 in one only\n"


def test_the_command_runs_as_python_dash_m(two):
    run = subprocess.run([sys.executable, "-m", "taktiny", "inspect", two[0], "--filter", "head.*"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env=cpu_environment())  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "1 tensors, 6 parameters, 6 bytes"


def test_listing_a_header_imports_neither_jax_nor_ml_dtypes(tmp_path):
    # JAX's import takes seconds, ml_dtypes' about one (it registers NumPy loops for every
    # type it defines), NumPy's a fifth of one: `taktiny inspect` reads a header, which
    # names dtypes and needs none of them, even for bfloat16 and float8 tensors
    path = tmp_path / "half.safetensors"
    safetensors.numpy.save_file({"w": np.ones((2, 3), ml_dtypes.bfloat16),
                                 "f8": np.zeros(4, ml_dtypes.float8_e4m3fn)}, str(path))  # fmt: skip
    code = (
        "import sys\n"
        "from taktiny._cli import main\n"
        f"assert main(['inspect', {str(path)!r}]) == 0\n"
        "print(sorted(m for m in ('jax', 'ml_dtypes', 'torch', 'numpy._core') if m in sys.modules))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[-2:] == ["2 tensors, 10 parameters, 16 bytes", "[]"], run.stdout
    assert "bfloat16" in run.stdout and "float8_e4m3fn" in run.stdout


def orbax(path, tree):
    path = path.absolute()  # Orbax takes absolute paths only
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, tree)
    return str(path)


@pytest.fixture
def two_orbax(tmp_path):
    a = orbax(tmp_path / "a", {
        "encoder": {"kernel": np.ones((2, 3), np.float32), "bias": np.zeros(4, ml_dtypes.bfloat16)},
        "layers": [np.arange(3, dtype=np.int32), np.full(2, 0.25, np.float32)],
    })  # fmt: skip
    b = orbax(tmp_path / "b", {
        "encoder": {"kernel": np.ones((2, 3), np.float32), "bias": np.zeros(5, ml_dtypes.bfloat16)},
        "layers": [np.arange(3, dtype=np.int32), np.array([0.25, -1.75], np.float32)],
        "extra": np.zeros(1, np.float32),
    })  # fmt: skip
    return a, b


def test_diff_compares_orbax_checkpoints_by_their_tree_paths(two_orbax, capsys):
    a, b = two_orbax
    assert main(["diff", a, b]) == 1
    assert capsys.readouterr().out == (
        f"only in {b}: extra\n"
        "name          shape         dtype     max |a - b|  max |a - b| / |b|\n"
        "encoder.bias  (4,) vs (5,)  bfloat16            -                  -\n"
        "layers.1      (2,)          float32             2            1.14286\n"
        "4 common tensors, 2 differ, 1 in one only\n"
    )
    assert main(["diff", b, b]) == 0
    assert capsys.readouterr().out == "5 common tensors, 0 differ, 0 in one only\n"


def test_diff_compares_an_orbax_checkpoint_with_safetensors(tmp_path, two_orbax, capsys):
    a, _ = two_orbax
    same = save(tmp_path / "same.safetensors", {
        "encoder.kernel": np.ones((2, 3), np.float32),
        "encoder.bias": np.zeros(4, ml_dtypes.bfloat16),
        "layers.0": np.arange(3, dtype=np.int32),
        "layers.1": np.full(2, 0.25, np.float32),
    })  # fmt: skip
    assert main(["diff", a, same]) == 0
    assert capsys.readouterr().out == "4 common tensors, 0 differ, 0 in one only\n"
    other = save(tmp_path / "other.safetensors", {
        "encoder.kernel": np.ones((2, 3), np.float64),  # equal values, another dtype
        "encoder.bias": np.zeros(4, ml_dtypes.bfloat16),
        "layers.0": np.array([0, 1, -2], np.int32),
    })  # fmt: skip
    assert main(["diff", other, a]) == 1
    assert capsys.readouterr().out == (
        f"only in {a}: layers.1\n"
        "name      shape  dtype  max |a - b|  max |a - b| / |b|\n"
        "layers.0  (3,)   int32            4                  2\n"
        "3 common tensors, 1 differ, 1 in one only\n"
    )


def test_diff_holds_two_tensors_at_a_time_and_restores_one_orbax_array_per_read(
    tmp_path, monkeypatch, capsys
):
    tree = {f"w{i}": np.full((4, 4), i, np.float32) for i in range(6)}
    a, b = (
        orbax(tmp_path / "a", tree),
        orbax(tmp_path / "b", {**tree, "w5": np.zeros((4, 4), np.float32)}),
    )
    restored = []  # the arrays each restore brought back
    restore = ocp.PyTreeCheckpointer.restore

    def counting_restore(self, *args, **kwargs):
        result = restore(self, *args, **kwargs)
        restored.append(len(jax.tree.leaves(result)))
        return result

    live, most, reads = set(), [0], [0]  # ids of the arrays read and not yet freed
    read = _cli._read

    def counting_read(entry, opened):
        array = read(entry, opened)
        reads[0] += 1
        live.add(id(array))
        weakref.finalize(array, live.discard, id(array))
        most[0] = max(most[0], len(live))
        return array

    monkeypatch.setattr(ocp.PyTreeCheckpointer, "restore", counting_restore)
    monkeypatch.setattr(_cli, "_read", counting_read)
    assert main(["diff", a, b]) == 1
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "w5    (4, 4)  float32            5                inf", "6 common tensors, 1 differ, 0 in one only"]  # fmt: skip
    assert reads[0] == 12 and restored == [1] * 12  # each restore: one array
    assert most[0] == 2  # one per side at a time


def flip_byte(file, name, at):
    """Flips the low bit of byte `at` of tensor `name` in `file`."""
    from taktiny.io import open_safetensors

    offset = open_safetensors(file)[name].offset
    data = bytearray(file.read_bytes())
    data[offset + at] ^= 1
    file.write_bytes(bytes(data))


def test_verify_reports_every_damaged_tensor_and_exits_with_1(tmp_path, capsys):
    from taktiny.io import save_safetensors

    path = tmp_path / "model.safetensors"
    save_safetensors(
        path, {"a": np.arange(64, dtype=np.float32), "b": np.ones(8, np.int8), "c": np.zeros(3)}
    )
    assert main(["verify", str(path)]) == 0
    assert (
        capsys.readouterr().out
        == "3 tensors match their checksums, 0 damaged, 0 without a checksum (their headers checked only)\n"
    )
    flip_byte(path, "a", 5)
    flip_byte(path, "b", 2)
    assert main(["verify", str(tmp_path)]) == 1  # the folder's checkpoint
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[-1].startswith("1 tensors match their checksums, 2 damaged")
    for line, name in zip(lines[:2], "ab", strict=True):
        assert re.fullmatch(
            rf"{re.escape(str(path))}: the bytes of '{name}' are damaged: their checksum is [0-9a-f]{{32}}, and the header records [0-9a-f]{{32}} \(xxh3_128\)\..*",
            line,
        ), line


def test_verify_reads_shards_and_files_without_checksums(tmp_path, capsys):
    from taktiny.io import save_safetensors

    save_safetensors(
        tmp_path / "model.safetensors",
        {f"t{i}": np.full(100, i, np.float32) for i in range(4)},
        max_shard_size=800,
    )
    assert main(["verify", str(tmp_path / "model.safetensors")]) == 0  # the path of a sharded save
    assert capsys.readouterr().out.startswith("4 tensors match their checksums, 0 damaged")
    hf = tmp_path / "hf"
    hf.mkdir()
    save(hf / "model.safetensors", {"w": np.ones(2, np.float32)})
    assert main(["verify", str(hf)]) == 0
    assert (
        capsys.readouterr().out
        == "0 tensors match their checksums, 0 damaged, 1 without a checksum (their headers checked only)\n"
    )
    refused(
        capsys, ["verify", str(tmp_path / "none.safetensors")], r"none\.safetensors does not exist"
    )
    (hf / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    refused(capsys, ["verify", str(hf)], r"hf/model\.safetensors: ")


def test_verify_restores_every_array_of_an_orbax_checkpoint(tmp_path, capsys):
    import orbax.checkpoint as ocp

    path = (tmp_path / "orbax").absolute()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(
            path, {"a": np.arange(1000, dtype=np.float32), "b": np.ones(10, np.float32)}
        )
    assert main(["verify", str(path)]) == 0
    assert capsys.readouterr().out == "2 arrays restore, 0 do not\n"
    data = [f for f in (path / "ocdbt.process_0" / "d").iterdir()]
    largest = max(data, key=lambda f: f.stat().st_size)  # the chunk holding "a"
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
    assert main(["verify", str(path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "1 arrays restore, 1 do not"
    assert re.fullmatch(
        rf"{re.escape(str(path))}: the array 'a' cannot be restored \(.*\)\.", lines[0]
    )


def test_a_folder_is_read_as_the_loaders_read_it(tmp_path, capsys):
    # a save of one file over shards, killed after its commit: the stale index is not data
    from taktiny.io import save_safetensors

    save_safetensors(
        tmp_path / "model.safetensors",
        {f"old{i}": np.ones(100, np.float32) for i in range(3)},
        max_shard_size=800,
    )
    single = tmp_path / "single"
    single.mkdir()
    save_safetensors(single / "model.safetensors", {"new": np.ones(2, np.float32)})
    (single / "model.safetensors").rename(tmp_path / "model.safetensors")
    assert main(["inspect", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "new   (2,)   float32      8",
        "1 tensors, 2 parameters, 8 bytes",
    ]


def test_diff_compares_across_dtypes_within_a_tolerance_and_a_filter(tmp_path, capsys):
    values = np.array([1.0, -2.5, 3.14159, 1e-3], np.float32)
    full = save(tmp_path / "f32.safetensors", {"encoder.w": values, "head.w": values})
    half = save(tmp_path / "bf16.safetensors", {
        "encoder.w": values.astype(ml_dtypes.bfloat16), "head.w": values + 1.0})  # fmt: skip
    bf16 = values.astype(ml_dtypes.bfloat16).astype(np.float64)
    gap = np.abs(values.astype(np.float64) - bf16)
    assert main(["diff", full, half, "--filter", "encoder.**"]) == 1  # bf16 rounds: not equal
    assert capsys.readouterr().out == (
        "name       shape  dtype                max |a - b|  max |a - b| / |b|\n"
        f"encoder.w  (4,)   float32 vs bfloat16  {gap.max():>11.6g}  {(gap / np.abs(bf16)).max():>17.6g}\n"
        "1 common tensors, 1 differ, 0 in one only\n"
    )
    assert main(["diff", full, half, "--filter", "encoder.**", "--rtol", "0.004"]) == 0
    assert (
        capsys.readouterr().out
        == "1 common tensors, 0 differ beyond atol=0, rtol=0.004, 0 in one only\n"
    )
    assert gap.max() > 0.0005
    assert main(["diff", full, half, "--filter", "encoder.**", "--atol", "0.0005"]) == 1
    capsys.readouterr()
    assert main(["diff", full, half, "--atol", "0.01"]) == 1  # head.w is 1 away
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "head.w  (4,)   float32            1           0.999001",
        "2 common tensors, 1 differ beyond atol=0.01, rtol=0, 0 in one only",
    ]
    assert main(["diff", full, half, "--atol", "1.0001"]) == 0  # (float32 rounds 1e-3 + 1)
    capsys.readouterr()
    refused(capsys, ["diff", full, half, "--filter", "a..b"], r"a\.\.b")


def test_diff_matches_nans_in_place_and_compares_large_integers_exactly(tmp_path, capsys):
    a = save(tmp_path / "a.safetensors", {
        "f": np.array([np.nan, np.inf, 1.0], np.float32),
        "i": np.array([2**62, 5], np.int64)})  # fmt: skip
    same = save(tmp_path / "same.safetensors", {
        "f": np.array([np.nan, np.inf, 1.0], np.float32),
        "i": np.array([2**62, 5], np.int64)})  # fmt: skip
    other = save(tmp_path / "other.safetensors", {
        "f": np.array([1.0, np.inf, 1.0], np.float32),
        "i": np.array([2**62 + 1, 5], np.int64)})  # fmt: skip
    assert main(["diff", a, same]) == 0
    assert capsys.readouterr().out == "2 common tensors, 0 differ, 0 in one only\n"
    assert main(["diff", a, other, "--atol", "100"]) == 1  # NaN against a number never agrees
    assert capsys.readouterr().out.splitlines()[1:] == [
        "f     (3,)   float32            0                  0",  # (NaN is no number to measure)
        "2 common tensors, 1 differ beyond atol=100, rtol=0, 0 in one only",
    ]
    assert main(["diff", a, other]) == 1  # 2**62 and 2**62 + 1: the same float64, not equal
    assert capsys.readouterr().out.splitlines()[1:] == [
        "f     (3,)   float32            0                  0",
        "i     (2,)   int64              1         2.1684e-19",  # 1 / 2**62
        "2 common tensors, 2 differ, 0 in one only",
    ]


@pytest.fixture
def managed(tmp_path):
    """Step folders of two CheckpointManagers: one saving a single unnamed item, one saving
    two named items."""
    model = nn.Linear(3, 2, rngs=nn.Rngs(0))
    run = (tmp_path / "run").absolute()
    with ocp.CheckpointManager(run) as manager:
        for step in (100, 200):
            manager.save(step, args=ocp.args.StandardSave(model.state_dict()))
        manager.wait_until_finished()
    multi = (tmp_path / "multi").absolute()
    with ocp.CheckpointManager(multi, item_names=("state", "extra")) as manager:
        manager.save(5, args=ocp.args.Composite(
            state=ocp.args.StandardSave(model.state_dict()),
            extra=ocp.args.StandardSave({"step": np.array([5], np.int32)})))  # fmt: skip
        manager.wait_until_finished()
    return model, run, multi


def test_inspect_and_diff_read_the_step_folders_of_a_checkpoint_manager(tmp_path, managed, capsys):
    model, run, multi = managed
    assert main(["inspect", str(run / "100")]) == 0  # one unnamed item: a checkpoint's names
    assert capsys.readouterr().out.splitlines()[1:] == [
        "bias    (2,)    float32      8",
        "kernel  (3, 2)  float32     24",
        "2 tensors, 8 parameters, 32 bytes",
    ]
    assert main(["inspect", str(multi / "5")]) == 0  # every item, under its name
    assert capsys.readouterr().out.splitlines()[1:] == [
        "extra.step    (1,)    int32        4",
        "state.bias    (2,)    float32      8",
        "state.kernel  (3, 2)  float32     24",
        "3 tensors, 9 parameters, 36 bytes",
    ]
    assert main(["inspect", str(multi / "5" / "state"), "--json"]) == 0  # one item by name
    assert [t["name"] for t in json.loads(capsys.readouterr().out)["tensors"]] == ["bias", "kernel"]
    from taktiny.io import save_safetensors

    save_safetensors(tmp_path / "model.safetensors", model)
    assert main(["diff", str(run / "200"), str(tmp_path / "model.safetensors")]) == 0
    assert capsys.readouterr().out == "2 common tensors, 0 differ, 0 in one only\n"
    assert main(["diff", str(multi / "5"), str(run / "100"), "--filter", "state.**"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"only in {multi / '5'}: state.bias",
        f"only in {multi / '5'}: state.kernel",
        "0 common tensors, 0 differ, 2 in one only",
    ]  # the filter applies to both sides
    assert main(["verify", str(multi / "5")]) == 0
    assert capsys.readouterr().out == "3 arrays restore, 0 do not\n"
    refused(capsys, ["inspect", str(run)],
            rf"^taktiny: {re.escape(str(run))} holds the steps of an Orbax CheckpointManager "
            rf"\(100, 200\): name one, as in {re.escape(str(run / '200'))}\.$")  # fmt: skip


# the model factories of `diff` and `plan`: imported as Python imports them

LLAMA_MODELS = """
import sys
sys.path.insert(0, {examples!r})
from transformers import LlamaForCausalLM  # the class every model of examples/llama.py loads

from llama import Llama, llama_config
from taktiny import nn


def tied():
    return Llama(llama_config(True), rngs=nn.Rngs(0))


def untied():
    return Llama(llama_config(False), rngs=nn.Rngs(0))
"""


@pytest.mark.program
@pytest.mark.thorough  # (20 s, importing transformers: `make property` runs it)
def test_diff_imports_a_factory_module_that_imports_transformers_model_classes(tmp_path):
    # a lazily loaded NumPy left in sys.modules by the command made SciPy's import fail
    # inside transformers' (module 'numpy._core' has no attribute '_multiarray_umath'),
    # which transformers reported as "Could not import module 'LlamaForCausalLM'"
    (tmp_path / "llama_models.py").write_text(LLAMA_MODELS.format(examples=str(ROOT / "examples")))
    run = subprocess.run(
        [sys.executable, "-m", "taktiny", "diff", "llama_models:tied", "llama_models:untied"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
        env=cpu_environment(PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert (run.returncode, run.stderr) == (1, ""), run.stderr
    assert run.stdout.splitlines() == [
        "added       lm_head.kernel: float32[64, 128]",
        "1 changes from llama_models:tied to llama_models:untied: 1 added",
    ]


def test_no_lazily_loaded_module_is_left_in_sys_modules(tmp_path):
    # in a fresh interpreter (NumPy not imported yet, as for the command): each command's
    # main, in-process; then imports of NumPy's and SciPy's own modules, which a lazily
    # loaded NumPy in sys.modules broke
    from taktiny.io import save_safetensors

    path = tmp_path / "a.safetensors"
    save_safetensors(path, {"w": np.arange(6, dtype=np.float32).reshape(2, 3)})
    code = (
        "import importlib.util, sys\n"
        "from taktiny._cli import main\n"
        "def lazy():\n"
        "    return sorted(name for name, m in list(sys.modules.items())\n"
        "                  if type(m).__module__ == 'importlib.util'  # its _LazyModule\n"
        "                  or isinstance(getattr(getattr(m, '__spec__', None), 'loader', None),\n"
        "                                importlib.util.LazyLoader))\n"
        f"assert main(['inspect', {str(path)!r}]) == 0\n"
        "print('after inspect:', 'numpy' in sys.modules, lazy())\n"
        f"assert main(['verify', {str(path)!r}]) == 0\n"
        f"assert main(['diff', {str(path)!r}, {str(path)!r}]) == 0\n"
        "print('after verify and diff:', 'numpy' in sys.modules, lazy())\n"
        "import numpy.testing, scipy.linalg\n"
        "numpy.testing.assert_array_equal(scipy.linalg.inv([[2.0]]), [[0.5]])\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr
    said = [line for line in run.stdout.splitlines() if line.startswith("after ")]
    assert said == ["after inspect: False []", "after verify and diff: True []"], run.stdout


def test_a_module_imported_when_first_used_never_enters_sys_modules_before(tmp_path, monkeypatch):
    # importlib.util.LazyLoader put a module that loads on first use into sys.modules,
    # where the import of its submodules by others (SciPy's of numpy.testing) failed
    from taktiny import _lazy

    package = tmp_path / "deferred_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("VALUE = 41\n")
    (package / "sub.py").write_text("from deferred_pkg import VALUE\nNEXT = VALUE + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        deferred = _lazy.module("deferred_pkg")
        assert "deferred_pkg" not in sys.modules
        assert deferred.VALUE == 41  # the first read imports it, as `import` does
        assert type(sys.modules["deferred_pkg"]) is type(sys)
        import deferred_pkg.sub

        assert deferred_pkg.sub.NEXT == 42
        assert _lazy.module("deferred_pkg") is sys.modules["deferred_pkg"]  # imported: itself
    finally:
        for name in ("deferred_pkg", "deferred_pkg.sub"):
            sys.modules.pop(name, None)


FAILING_MODULES = {
    "wrapping": "raise ModuleNotFoundError(\"Could not import module 'Thing'\") from (\n"
    "    AttributeError('the real cause'))\n",
    "needs_dependency": "import not_an_installed_dependency\n",
    "handles_badly": "try:\n    import not_an_installed_dependency\nexcept ImportError:\n"
    "    raise RuntimeError('handles_badly needs not_an_installed_dependency')\n",
    "exits": "import sys\nsys.exit(3)\n",
    "bad_syntax": "def model(:\n",
    "factories": "def broken():\n    raise RuntimeError('no weights here')\n"
    "def from_sibling():\n    import sibling\n    return sibling.model()\n",
    "sibling": "import jax.numpy as jnp\ndef model():\n    return {'w': jnp.zeros((2, 3))}\n",
}


@pytest.fixture
def failing(tmp_path, monkeypatch):
    for name, text in FAILING_MODULES.items():
        (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name in FAILING_MODULES:
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (  # transformers' lazy import wraps the real error: both are shown, and where
            "wrapping:model",
            r"wrapping:model: cannot import 'wrapping': ModuleNotFoundError: Could not import "
            r"module 'Thing'; raised from AttributeError: the real cause \(at \S+/wrapping\.py:1\)$",
        ),
        (  # a dependency of the module is missing, not the module
            "needs_dependency:model",
            r"needs_dependency:model: cannot import 'needs_dependency': ModuleNotFoundError: No "
            r"module named 'not_an_installed_dependency' \(at \S+/needs_dependency\.py:1\)$",
        ),
        (
            "handles_badly:model",
            r"handles_badly:model: cannot import 'handles_badly': RuntimeError: handles_badly "
            r"needs not_an_installed_dependency; raised while handling ModuleNotFoundError: No "
            r"module named 'not_an_installed_dependency' \(at \S+/handles_badly\.py:2\)$",
        ),
        (
            "absent_models:model",
            r"absent_models:model: cannot import 'absent_models': ModuleNotFoundError: No module "
            r"named 'absent_models' \(looked in the current folder, \S+, and the installed "
            r"packages\)$",
        ),
        (
            "exits:model",
            r"exits:model: cannot import 'exits': it exited while being imported, SystemExit: 3 "
            r"\(at \S+/exits\.py:2\); keep what runs as a script under "
            r"`if __name__ == '__main__':`$",
        ),
        (
            "bad_syntax:model",
            r"bad_syntax:model: cannot import 'bad_syntax': SyntaxError: .*\(bad_syntax\.py, "
            r"line 1\)$",
        ),
        (
            "factories:broken",
            r"factories:broken: calling broken\(\) failed: RuntimeError: no weights here \(at "
            r"\S+/factories\.py:2\)$",
        ),
    ],
)
def test_a_factory_that_fails_shows_the_real_error_and_where(failing, capsys, factory, message):
    refused(capsys, ["diff", factory, factory], rf"^taktiny: {message}")


def test_a_factory_imports_as_python_does_while_it_runs(failing, capsys):
    # the current folder stays on sys.path while the factory runs, which imports its own
    # modules then; and is taken off afterwards
    path = save(failing / "w.safetensors", {"w": np.zeros((2, 3), np.float32)})
    before = list(sys.path)
    assert main(["diff", path, "factories:from_sibling"]) == 0
    assert capsys.readouterr().out.startswith("the schemas agree: 1 names")
    assert main(["plan", path, "--model", "factories:from_sibling"]) == 0
    assert "the load would succeed" in capsys.readouterr().out
    assert sys.path == before
    refused(
        capsys,
        ["plan", path, "--model", "wrapping:model"],
        r"wrapping:model: cannot import 'wrapping': .*; raised from AttributeError: the real cause",
    )


@pytest.mark.parametrize("command", ["", "inspect", "diff", "verify", "plan"])
def test_help_prints_whole_sentences(capsys, command):
    # the description was the docstring's first line, cut mid-sentence; the commands' own
    # --help had none
    with pytest.raises(SystemExit, match=r"^0$"):
        main([command, "--help"] if command else ["--help"])
    out = capsys.readouterr().out
    blocks = [" ".join(block.split()) for block in out.split("\n\n")]
    prose = [b for b in blocks if not b.startswith(("usage:", "positional arguments:", "options:"))]
    assert len(prose) == 2, out  # what the command does, then its exit statuses
    for paragraph in prose:
        assert paragraph.endswith(".") and "`" not in paragraph, paragraph
        assert paragraph[0].isupper() or paragraph.startswith("taktiny "), paragraph
    if not command:
        first = " ".join(_cli.__doc__.split("\n\n")[0].replace("`", "").split())
        assert prose[0] == first and first.endswith("would take."), out
        assert prose[1].startswith("A checkpoint that cannot be read") and "(plan)." in prose[1]
    else:
        assert prose[1].startswith("Exits with 0"), out


@pytest.mark.parametrize("command", ["", "inspect", "diff", "verify", "plan"])
def test_help_says_that_urls_work(capsys, command):
    # `taktiny plan --help` (and inspect's, verify's) named only files and folders, though
    # every command reads s3:// URLs (tests/io/test_object_store.py runs them)
    with pytest.raises(SystemExit, match=r"^0$"):
        main([command, "--help"] if command else ["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "s3://" in out and "az://" in out, out
    if command in ("inspect", "verify", "plan"):
        assert "pip install 'taktiny[cloud]'" in out, out


def test_verify_tells_a_damaged_schema_or_checksum_record_from_damaged_bytes(tmp_path, capsys):
    # a bit flipped in the schema passed verify ("every tensor matches"); one flipped in a
    # recorded checksum was reported as damaged bytes
    from taktiny.io import open_safetensors, save_safetensors

    path = tmp_path / "model.safetensors"
    save_safetensors(path, {"a": np.arange(64, dtype=np.float32), "b": np.ones(8, np.int8)})
    original = path.read_bytes()
    for found, offset, message in [
        (b'\\"fingerprint\\":\\"', 18, r"its metadata entry 'taktiny_schema' is not the one Taktiny wrote"),
        (open_safetensors(path)["a"].checksum.encode(), 0, r"the checksums it records for its tensors \('taktiny_checksums'\) are not those Taktiny wrote: that record is damaged, not \(as far as the header tells\) the tensors' bytes"),
    ]:  # fmt: skip
        data = bytearray(original)
        data[data.index(found) + offset] ^= 1
        path.write_bytes(bytes(data))
        refused(
            capsys,
            ["verify", str(path)],
            rf"model\.safetensors: the header is damaged: .*{message}",
        )
    path.write_bytes(original)
    assert main(["verify", str(path)]) == 0
    assert capsys.readouterr().out.startswith("2 tensors match their checksums, 0 damaged")
