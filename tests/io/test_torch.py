"""taktiny.io.read_torch: PyTorch files read through torch.load(weights_only=True) only, bit
for bit, flat or nested, sharded with a Hugging Face index; everything else refused by name."""

import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch

import taktiny as tt
from taktiny.io import load_safetensors, open_safetensors, read_torch

UNPICKLED = []  # what unpickling a Thing ran


class Thing:
    """An arbitrary object: unpickling it runs its class's code (here, it says so)."""

    def __init__(self):
        self.state = "pickled"

    def __setstate__(self, state):
        UNPICKLED.append(state)


def mapped(path):
    """Whether this process maps `path` (Linux: /proc/self/maps lists it)."""
    return str(path.resolve()) in Path("/proc/self/maps").read_text()


def tensors():
    generator = torch.Generator().manual_seed(0)
    return {
        "encoder.weight": torch.randn(3, 4, generator=generator),
        "encoder.bias": torch.randn(4, generator=generator).to(torch.bfloat16),
        "steps": torch.tensor([-(2**40), 7, 2**62], dtype=torch.int64),
        "mask": torch.tensor([True, False]),
        "fp8": torch.tensor([0.5, -448.0], dtype=torch.float8_e4m3fn),
    }


def assert_bitwise(read, expected):
    assert list(read) == list(expected)
    for name, tensor in expected.items():
        array = read[name]
        assert isinstance(array, np.ndarray), name
        assert array.shape == tuple(tensor.shape), name
        assert array.dtype.itemsize == tensor.element_size(), name
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[array.itemsize]
        raw = tensor.view(bits) if tensor.dtype != torch.bool else tensor.to(torch.uint8)
        assert array.tobytes() == raw.numpy().tobytes(), name


def every_dtype():
    """A tensor of each dtype torch saves and safetensors stores, with odd bit patterns."""
    generator = torch.Generator().manual_seed(1)
    floats = torch.randn(2, 3, generator=generator) * 100
    return {
        **{f"f_{str(dtype)[6:]}": floats.to(dtype) for dtype in (torch.float32, torch.float16,
           torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float64)},
        **{f"i_{str(dtype)[6:]}": torch.randint(-100, 100, (2, 3), generator=generator).to(dtype)
           for dtype in (torch.int8, torch.int16, torch.int32, torch.int64)},
        "i_uint8": torch.randint(0, 256, (2, 3), generator=generator).to(torch.uint8),
        "b_bool": torch.randint(0, 2, (2, 3), generator=generator).to(torch.bool),
    }  # fmt: skip


def test_every_dtype_reads_bit_for_bit_from_torch_and_safetensors_files(tmp_path):
    expected = every_dtype()
    torch.save(expected, tmp_path / "model.bin")
    assert_bitwise(read_torch(tmp_path / "model.bin"), expected)
    safetensors.torch.save_file(expected, tmp_path / "model.safetensors")
    opened = open_safetensors(tmp_path / "model.safetensors")
    assert_bitwise({name: np.asarray(opened[name]) for name in expected}, expected)
    # loaded into a model of JAX dtypes: all but the 64-bit ones, which JAX keeps as 32-bit
    kept = {n: t for n, t in expected.items() if t.element_size() < 8}
    model = {n: jax.ShapeDtypeStruct((2, 3), jnp.dtype(n[2:])) for n in kept}
    safetensors.torch.save_file(kept, tmp_path / "kept.safetensors")
    loaded = load_safetensors(model, tmp_path / "kept.safetensors")
    flat = tt.flat_state_dict(loaded)
    assert sorted(flat) == sorted(kept)
    assert_bitwise({n: np.asarray(flat[n]) for n in kept}, kept)


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_a_state_dict_round_trips_bit_for_bit(tmp_path, zipped):
    expected = tensors()
    if not zipped:  # torch 2.13 cannot load float8 from its legacy format
        del expected["fp8"]
    path = tmp_path / "model.bin"
    torch.save(expected, path, _use_new_zipfile_serialization=zipped)
    read = read_torch(path)
    assert_bitwise(read, expected)
    if sys.platform == "linux":  # zip files are mapped, not read; legacy ones are read
        assert mapped(path) == zipped
    assert read["encoder.weight"].dtype == np.float32
    assert read["encoder.bias"].dtype == ml_dtypes.bfloat16
    assert read["steps"].dtype == np.int64 and read["steps"][0] == -(2**40)
    if zipped:
        assert read["fp8"].dtype == ml_dtypes.float8_e4m3fn
        assert read["fp8"].astype(np.float32).tolist() == [0.5, -448.0]
    read["encoder.weight"][0, 0] = 1e6  # writing into what was read never reaches the file
    assert_bitwise(read_torch(str(path)), expected)


def test_a_checkpoint_that_nests_the_state_is_flattened_with_dots(tmp_path):
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    checkpoint = {
        "model": {"encoder": {"weight": weight.t(), "bias": torch.ones(2)}},
        "optimizer": {"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": [{"lr": 0.1}]},
        "buffers": [torch.full((1,), 2.0), (torch.full((1,), 3.0),)],
        "step": 1000,
        "config": "tiny",
        "shape": torch.Size([2, 3]),
    }
    torch.save(checkpoint, tmp_path / "checkpoint.pt")
    read = read_torch(tmp_path / "checkpoint.pt")
    assert list(read) == [
        "model.encoder.weight", "model.encoder.bias", "optimizer.state.0.exp_avg",
        "buffers.0", "buffers.1.0",
    ]  # fmt: skip
    assert np.array_equal(read["model.encoder.weight"], weight.t().numpy())  # a strided view
    assert read["buffers.1.0"].tolist() == [3.0]


def test_two_values_with_one_dotted_name_are_refused(tmp_path):
    torch.save({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}, tmp_path / "twice.pt")
    with pytest.raises(ValueError, match=r"twice\.pt holds two tensors named 'a\.b'"):
        read_torch(tmp_path / "twice.pt")


@pytest.mark.parametrize("forced", [False, True], ids=["default", "unpickling-forced"])
def test_a_pickled_object_is_refused_and_never_unpickled(tmp_path, monkeypatch, forced):
    if forced:  # asks torch.load to unpickle anything where weights_only is not passed
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    UNPICKLED.clear()
    torch.save({"weight": torch.ones(2), "head": Thing()}, tmp_path / "model.pt")
    with pytest.raises(
        ValueError,
        match=r"torch\.load\(weights_only=True\) refused .*model\.pt \(Unsupported global: "
        r"GLOBAL .*Thing was not an allowed global by default\): it holds objects other than "
        r"tensors and plain containers, or is no PyTorch file\. Taktiny never unpickles "
        r"arbitrary objects\. Instead, save the tensors as safetensors .*"
        r"safetensors\.torch\.save_file",
    ):
        read_torch(tmp_path / "model.pt")
    torch.save(Thing(), tmp_path / "whole.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError, match=r"refused .*whole\.pt \(Unsupported global"):
        read_torch(tmp_path / "whole.pt")
    assert UNPICKLED == []


def test_files_that_are_not_state_dicts_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"none\.bin does not exist"):
        read_torch(tmp_path / "none.bin")
    (tmp_path / "junk.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"junk\.bin is not a readable PyTorch file \(.*\); "
                       r"expected a file written by torch\.save"):  # fmt: skip
        read_torch(tmp_path / "junk.bin")
    torch.save(torch.ones(2), tmp_path / "tensor.pt")
    with pytest.raises(ValueError, match=r"tensor\.pt holds a Tensor, not a dict"):
        read_torch(tmp_path / "tensor.pt")
    torch.save({"z": torch.eye(2).to_sparse()}, tmp_path / "sparse.pt")
    with pytest.raises(TypeError, match=r"'z' in .*sparse\.pt is a torch\.float32 tensor with "
                       r"layout torch\.sparse_coo, which NumPy cannot hold .*\.to_dense\(\)"):  # fmt: skip
        read_torch(tmp_path / "sparse.pt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty must hold one '\*\.bin\.index\.json' "
                       r"index or a 'pytorch_model\.bin' \(found: none"):  # fmt: skip
        read_torch(tmp_path / "empty")
    (tmp_path / "two").mkdir()
    for name in ("a", "b"):
        (tmp_path / "two" / f"{name}.bin.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(FileNotFoundError, match=r"two must hold one '\*\.bin\.index\.json' index "
                       r"or a 'pytorch_model\.bin' \(found: a\.bin\.index\.json, "
                       r"b\.bin\.index\.json\); pass the file to read$"):  # fmt: skip
        read_torch(tmp_path / "two")


def sharded(folder, weight_map=None):
    """A Hugging Face style sharded checkpoint of tensors() in `folder`, and its tensors."""
    expected = tensors()
    names = list(expected)
    torch.save({n: expected[n] for n in names[:2]}, folder / "pytorch_model-00001-of-00002.bin")
    torch.save({n: expected[n] for n in names[2:]}, folder / "pytorch_model-00002-of-00002.bin")
    if weight_map is None:
        weight_map = {n: f"pytorch_model-0000{1 + (i >= 2)}-of-00002.bin"
                      for i, n in enumerate(names)}  # fmt: skip
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return expected, weight_map


def test_a_sharded_checkpoint_is_read_through_its_index(tmp_path):
    expected, _ = sharded(tmp_path)
    assert_bitwise(read_torch(tmp_path), expected)
    assert_bitwise(read_torch(tmp_path / "pytorch_model.bin.index.json"), expected)
    (tmp_path / "pytorch_model.bin.index.json").unlink()
    torch.save({"only": torch.ones(1)}, tmp_path / "pytorch_model.bin")
    assert list(read_torch(tmp_path)) == ["only"]  # a folder with one unsharded file


@pytest.mark.parametrize("shard", ["../elsewhere.bin", "/tmp/elsewhere.bin", "."])
def test_an_index_naming_a_shard_outside_its_folder_is_refused(tmp_path, shard):
    (tmp_path / "model").mkdir()
    torch.save({"stolen": torch.ones(1)}, tmp_path / "elsewhere.bin")
    _, weight_map = sharded(tmp_path / "model")
    sharded(tmp_path / "model", {**weight_map, "stolen": shard})
    with pytest.raises(ValueError, match=r"names shards outside its folder .*model: "
                       + re.escape(repr(shard)) + "; an index may name only files next to it"):  # fmt: skip
        read_torch(tmp_path / "model")


def test_an_index_naming_missing_shards_or_tensors_is_refused(tmp_path):
    _, weight_map = sharded(tmp_path)
    sharded(tmp_path, {**weight_map, "late": "pytorch_model-00003-of-00002.bin"})
    with pytest.raises(FileNotFoundError,
                       match=r"names shards missing from .*: 'pytorch_model-00003-of-00002\.bin'$"):  # fmt: skip
        read_torch(tmp_path)
    sharded(tmp_path, {**weight_map, "late": "pytorch_model-00002-of-00002.bin"})
    with pytest.raises(ValueError, match=r"puts 'late' in the shard "
                       r"'pytorch_model-00002-of-00002\.bin', which does not hold them "
                       r"\(it holds 3 tensors\)"):  # fmt: skip
        read_torch(tmp_path)
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": ["a"]}))
    with pytest.raises(ValueError, match=r"index\.json has no 'weight_map' of tensor names"):
        read_torch(tmp_path)


def test_an_index_lists_every_shard_and_tensor_it_names_wrongly(tmp_path):
    index = re.escape(str(tmp_path / "pytorch_model.bin.index.json"))
    folder, first = re.escape(str(tmp_path.resolve())), "pytorch_model-00001-of-00002.bin"
    _, weight_map = sharded(tmp_path)
    sharded(tmp_path, {**weight_map, "x": "../x.bin", "y": "../y.bin"})
    with pytest.raises(ValueError, match=rf"^read_torch: {index} names shards outside its "
                       rf"folder {folder}: '\.\./x\.bin', '\.\./y\.bin'; an index may name "
                       r"only files next to it$"):  # fmt: skip
        read_torch(tmp_path)
    sharded(tmp_path, {**weight_map, "x": "x.bin", "y": "y.bin"})
    with pytest.raises(FileNotFoundError, match=rf"^read_torch: {index} names shards missing "
                       rf"from {folder}: 'x\.bin', 'y\.bin'$"):  # fmt: skip
        read_torch(tmp_path)
    sharded(tmp_path, {**weight_map, "x": first, "y": first})
    with pytest.raises(ValueError, match=rf"^read_torch: {index} puts 'x', 'y' in the shard "
                       rf"'{re.escape(first)}', which does not hold them \(it holds 2 "
                       r"tensors\)$"):  # fmt: skip
        read_torch(tmp_path)
    sharded(tmp_path)
    torch.save(torch.ones(2), tmp_path / first)
    with pytest.raises(ValueError, match=rf"^read_torch: {folder}/{re.escape(first)} holds a "
                       r"Tensor, not a dict"):  # fmt: skip
        read_torch(tmp_path)


def test_an_index_names_at_most_three_unnamed_shards_each_shortened(tmp_path):
    _, weight_map = sharded(tmp_path)
    unnamed = ["a" * 79 + "\0", "b" * 80 + "\0", "", "d\0", "e\0"]  # 80 and 81 characters
    sharded(tmp_path, {**weight_map, **{f"w{i}": s for i, s in enumerate(unnamed)}})
    shown = f"{unnamed[0]!r} (no file name), {'b' * 80!r}... (no file name), '' (no file name)"
    with pytest.raises(
        ValueError,
        match=rf"^read_torch: .* names shards that are no file names or cannot be resolved: "
        rf"{re.escape(shown)}; an index may name only files next to it$",
    ):
        read_torch(tmp_path)


def test_an_index_of_up_to_its_byte_limit_is_read(tmp_path, monkeypatch):
    from taktiny.io import _torch

    torch.save({"w": torch.ones(2)}, tmp_path / "one.bin")
    text = json.dumps({"weight_map": {"w": "one.bin"}})
    monkeypatch.setattr(_torch, "_INDEX_LIMIT", len(text) + 4)
    index = tmp_path / "pytorch_model.bin.index.json"
    index.write_text(text + " " * 4)  # at the limit
    assert list(read_torch(index)) == ["w"]
    index.write_text(text + " " * 5)
    with pytest.raises(ValueError, match=rf"^read_torch: {re.escape(str(index))} is not a JSON "
                       rf"object: it has more than {len(text) + 4} bytes$"):  # fmt: skip
        read_torch(index)


def test_a_checkpoint_may_name_up_to_its_limit_of_tensors(tmp_path, monkeypatch):
    from taktiny.io import _torch

    monkeypatch.setattr(_torch, "_MAX_TENSORS", 4)
    weight = torch.ones(1)
    four = {"a": weight, "b": [weight, {"c": weight}], "d": weight, "step": 3}
    torch.save(four, tmp_path / "four.pt")
    assert list(read_torch(tmp_path / "four.pt")) == ["a", "b.0", "b.1.c", "d"]
    torch.save({**four, "e": weight}, tmp_path / "five.pt")
    with pytest.raises(ValueError, match=rf"^read_torch: {re.escape(str(tmp_path / 'five.pt'))} "
                       r"names more than 4 tensors \(it repeats containers inside each other\); "
                       r"it is no checkpoint$"):  # fmt: skip
        read_torch(tmp_path / "five.pt")


def test_a_container_held_at_several_paths_is_named_and_counted_once_per_path(
    tmp_path, monkeypatch
):
    from taktiny.io import _torch

    monkeypatch.setattr(_torch, "_MAX_TENSORS", 4)
    shared = {"w": torch.ones(1)}  # pickled once: loaded as one dict, held at three paths
    torch.save({"a": shared, "b": {"c": shared}, "d": [shared]}, tmp_path / "three.pt")
    read = read_torch(tmp_path / "three.pt")
    assert list(read) == ["a.w", "b.c.w", "d.0.w"]
    assert all(array.tolist() == [1.0] for array in read.values())
    pair = {"x": torch.ones(1), "y": torch.zeros(1)}  # 2 + 2 * 2 = 6 names, more than 4
    torch.save({"a": pair, "b": [pair, pair]}, tmp_path / "six.pt")
    with pytest.raises(ValueError, match=rf"^read_torch: {re.escape(str(tmp_path / 'six.pt'))} "
                       r"names more than 4 tensors \(it repeats containers"):  # fmt: skip
        read_torch(tmp_path / "six.pt")


def test_a_checkpoint_saved_on_a_gpu_is_read_on_the_cpu(tmp_path, monkeypatch):
    import zipfile

    # torch.save records each storage's device: here cuda:0, as a save on a GPU does
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
    torch.save({"w": torch.arange(3.0)}, tmp_path / "gpu.pt")
    monkeypatch.undo()
    with zipfile.ZipFile(tmp_path / "gpu.pt") as archive:
        assert b"cuda:0" in archive.read("gpu/data.pkl")
    read = read_torch(tmp_path / "gpu.pt")  # on this CPU-only machine too
    assert read["w"].dtype == np.float32 and read["w"].tolist() == [0.0, 1.0, 2.0]


def test_without_torch_the_error_says_to_install_it_or_convert(tmp_path, monkeypatch):
    torch.save({"weight": torch.ones(2)}, tmp_path / "model.bin")
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now fails
    with pytest.raises(ImportError, match=r"reading the PyTorch file .*model\.bin needs "
                       r"PyTorch, which is not installed: pip install torch\. Or, instead, save "
                       r"the tensors as safetensors .*safetensors\.torch\.save_file"):  # fmt: skip
        read_torch(tmp_path / "model.bin")
