"""`taktiny inspect` and `taktiny diff` on safetensors files, indexes and Orbax checkpoints."""

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy

from taktiny import nn
from taktiny._cli import main

ROOT = Path(__file__).resolve().parent.parent


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
        "name            shape   dtype  bytes\n"
        "encoder.bias    (4,)    BF16       8\n"
        "encoder.kernel  (2, 3)  F32       24\n"
        "head.kernel     (3, 2)  I8         6\n"
        "3 tensors, 16 parameters, 38 bytes\n"
    )
    assert main(["inspect", two[0], "--filter", "encoder.*", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in listed["tensors"]] == ["encoder.bias", "encoder.kernel"]
    assert listed["tensors"][1] == {"name": "encoder.kernel", "shape": [2, 3], "dtype": "F32",
                                    "bytes": 24}  # fmt: skip
    assert (listed["parameters"], listed["bytes"]) == (10, 32)


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
    with pytest.raises(SystemExit, match=r"names the shard '\.\./elsewhere\.safetensors', "
                       r"outside its folder"):  # fmt: skip
        main(["inspect", str(tmp_path)])
    index["weight_map"]["c"] = "model-00003-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SystemExit, match=r"names the shard 'model-00003-of-00002.safetensors', "
                       r"which is missing"):  # fmt: skip
        main(["inspect", str(tmp_path)])


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


def test_bad_checkpoints_are_clear_errors(tmp_path):
    with pytest.raises(SystemExit, match=r"does not exist"):
        main(["inspect", str(tmp_path / "none.safetensors")])
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(SystemExit, match=r"broken.safetensors is not a readable safetensors file"):
        main(["inspect", str(broken)])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match=r"holds no Orbax checkpoint and not exactly one"):
        main(["inspect", str(tmp_path / "empty")])


def test_diff_reports_names_in_one_only_shape_changes_and_the_largest_difference(two, capsys):
    assert main(["diff", two[0], two[1]]) == 1
    assert capsys.readouterr().out == (
        f"only in {two[1]}: extra\n"
        "name            shape         dtype         max |a - b|\n"
        "encoder.bias    (4,) vs (5,)  BF16 vs BF16            -\n"
        "encoder.kernel  (2, 3)        F32                   0.5\n"
        "3 common tensors, 2 differ, 1 in one only\n"
    )
    assert main(["diff", two[0], two[0]]) == 0
    assert capsys.readouterr().out == "3 common tensors, 0 differ, 0 in one only\n"


def test_the_command_runs_as_python_dash_m(two):
    run = subprocess.run([sys.executable, "-m", "taktiny", "inspect", two[0], "--filter", "head.*"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "1 tensors, 6 parameters, 6 bytes"
