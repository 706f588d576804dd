"""A load's scratch buffers over many steps: each buffer takes three or more steps, larger
after smaller and smaller again, and is mapped once, as large as the most its steps read;
every step reads into it at offsets that are multiples of 64 bytes, and no loaded leaf
keeps the buffer's memory, which the next step through it reads over (a leaf that did
would hold a later tensor's bytes). With two steps per load a buffer is never read into
twice, and none of this is seen."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taktiny as tt
import taktiny.loading._place as place
from taktiny import convert as cv
from taktiny import nn
from taktiny.io import load_safetensors, save_safetensors

# elements of each step's two float32 sources, in the file's order: the steps take turns in
# two buffers, (0, 2, 4, 6) and (1, 3, 5); sizes not multiples of 16 (64 bytes)
SIZES = [(37, 5), (300, 211), (1003, 777), (11, 3), (50, 29), (2001, 1999), (400, 9)]


@pytest.fixture
def mapped(monkeypatch):
    """Each read into a scratch buffer: (the buffer, its memory, its size, the offsets of
    the arrays read from its start, the first source's name)."""
    log, read = [], place.Scratch.read

    def logged(self, tensors, verify, perm=None):
        out = read(self, tensors, verify, perm)
        offsets = [a.ctypes.data - self.start for a in out]
        log.append((self, self.memory, self.size, offsets, tensors[0].name))
        return out

    monkeypatch.setattr(place.Scratch, "read", logged)
    return log


def _one_mapping_each(log, expected_sizes):
    """Every buffer's reads found one memory, mapped at the most its steps read."""
    # (in the order of their first steps: two readers may log step 1 before step 0)
    buffers = list(dict.fromkeys(entry[0] for entry in sorted(log, key=lambda e: e[4])))
    assert len(buffers) == len(expected_sizes)
    for buffer, size in zip(buffers, expected_sizes, strict=True):
        mine = [entry for entry in log if entry[0] is buffer]
        assert len(mine) >= 3  # (the case this file is for)
        assert all(entry[1] is mine[0][1] for entry in mine), "the buffer was mapped again"
        assert {entry[2] for entry in mine} == {size}
        assert len(mine[0][1]) == size


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
def test_two_buffers_each_take_three_steps_and_are_mapped_once(tmp_path, mapped, verify):
    rng = np.random.default_rng(0)
    tensors = {}
    for k, (m, n) in enumerate(SIZES):
        tensors[f"s{k}.a"] = rng.standard_normal(m).astype(np.float32)
        tensors[f"s{k}.b"] = rng.standard_normal(n).astype(np.float32)
    path = tmp_path / "steps.safetensors"
    save_safetensors(path, tensors)
    # a rename of two tensors at once goes through a buffer, and its results are the
    # arrays read into it; a cast makes new ones
    rules = [cv.Rule(["s{k}.a", "s{k}.b"], ["t{k}.a", "t{k}.b"])]
    target = {f"t{k}": {"a": jax.ShapeDtypeStruct((m,), jnp.float32),
                        "b": jax.ShapeDtypeStruct((n,), jnp.float32)}
              for k, (m, n) in enumerate(SIZES)}  # fmt: skip
    target["t5"]["a"] = jax.ShapeDtypeStruct((SIZES[5][0],), jnp.bfloat16)  # (cast)
    loaded = load_safetensors(target, path, rules=rules, verify=verify)
    for k in range(len(SIZES)):
        for part in "ab":
            want = tensors[f"s{k}.{part}"]
            got = np.asarray(loaded[f"t{k}"][part])
            if (k, part) == (5, "a"):
                want = want.astype(jnp.bfloat16)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (k, part)
    # each step's sources at multiples of 64 bytes, in the order it reads them
    by_step = {entry[4]: entry[3] for entry in mapped}
    for k, (m, _) in enumerate(SIZES):
        assert by_step[f"s{k}.a"] == [0, -(-m * 4 // 64) * 64], k
    # the steps take turns, and each buffer is as large as the largest of its steps
    order = [int(entry[4][1]) for entry in mapped]
    assert sorted(order) == list(range(len(SIZES)))
    need = [-(-m * 4 // 64) * 64 + -(-n * 4 // 64) * 64 for m, n in SIZES]
    _one_mapping_each(mapped, [max(need[0::2]), max(need[1::2])])


def test_a_quantizing_load_reads_every_step_through_one_buffer(tmp_path, mapped):
    def make():  # kernels of 8, 128, 16 then 64 KiB: larger, smaller, larger again
        widths = [(32, 64), (256, 128), (64, 64), (128, 128)]
        return [nn.Linear(i, o, use_bias=False, rngs=nn.Rngs(k)) for k, (i, o) in enumerate(widths)]

    model = make()
    path = tmp_path / "float.safetensors"
    save_safetensors(path, model)
    loaded = load_safetensors(tt.quantize(jax.eval_shape(make)), path)
    expected = tt.quantize(model)
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(expected), strict=True):
        assert got.dtype == want.dtype and np.asarray(got).tobytes() == np.asarray(want).tobytes()
    assert [entry[4] for entry in mapped] == [f"{k}.kernel" for k in range(4)]
    _one_mapping_each(mapped, [256 * 128 * 4])


def test_a_buffer_too_small_for_a_step_is_mapped_again_and_then_reused(tmp_path):
    """Scratch itself, given less than a step needs (a size worked out wrongly): the step
    still reads whole, into a larger mapping, which the next steps reuse."""
    from taktiny.io import open_safetensors

    rng = np.random.default_rng(1)
    arrays = {
        f"x{k}": rng.standard_normal(n).astype(np.float32) for k, n in enumerate([10, 40, 20, 30])
    }
    path = tmp_path / "x.safetensors"
    save_safetensors(path, arrays)
    checkpoint = open_safetensors(path)
    scratch = place.Scratch(64 * 2)  # (room for x0, not x1)
    memories = []
    for name, array in arrays.items():
        (got,) = scratch.read([checkpoint[name]], verify=True)
        assert got.tobytes() == array.tobytes(), name
        assert got.ctypes.data == scratch.start  # in the mapping the buffer holds now
        memories.append(scratch.memory)
    assert memories[0] is not memories[1] and memories[1] is memories[2] is memories[3]
    assert scratch.size == -(-40 * 4 // 64) * 64  # the step that needed more, rounded up
    held = jax.device_put(got, jax.devices()[0])  # (adopted: the buffer's own memory)
    assert scratch.holds(held) and not scratch.holds(jnp.array(got))
