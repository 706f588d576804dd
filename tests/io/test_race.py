"""Readers racing a save: while one process saves two states in turn over one path (4
shards, 6 shards, one file), this one opens and loads the path again and again; every read
gives bitwise one of the two states, never an error and never a mix. The harness is
tests/_race.py; property_tests/test_race.py races larger checkpoints, for longer under
``make property``."""

import jax.numpy as jnp
import pytest
from _race import as_bytes, race, state

from taktiny.io import SafetensorsError, load_safetensors, open_safetensors, save_safetensors
from taktiny.io import _checkpoint as checkpoint_module
from taktiny.io._checkpoint import SHARD


@pytest.mark.program
def test_reads_racing_saves_give_one_whole_state(tmp_path):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    counts = race(folder, seconds=3.0, reads=60)
    print(f"reads racing saves: {counts}")
    assert counts["errors"] == 0 and counts["wrong"] == 0, counts["problems"]
    assert counts["reads"] >= 60 and counts["saves"] >= 10, counts
    assert counts["A"] and counts["B"], counts  # the reads saw both states
    assert counts["overlapping"] >= counts["reads"] // 2, counts  # most fell during saves


LAYOUTS = {"one file": None, "4 shards": 16 * 1024, "6 shards": 12 * 1024}


def save(path, seed, layout):
    return save_safetensors(path, state(seed), max_shard_size=LAYOUTS[layout])


@pytest.mark.parametrize("before", list(LAYOUTS))
@pytest.mark.parametrize("after", list(LAYOUTS))
def test_an_opened_checkpoint_reads_what_it_opened_after_saves_replace_it(tmp_path, before, after):
    path = tmp_path / "model.safetensors"
    save(path, 0, before)
    checkpoint = open_safetensors(path)
    for seed in (1, 2):  # (the second save removes the files the first left behind)
        save(path, seed, after)
    assert as_bytes({n: t.read() for n, t in checkpoint.items()}) == as_bytes(state(0))
    target = {n: jnp.zeros(a.shape, a.dtype) for n, a in state(0).items()}
    assert as_bytes(load_safetensors(target, checkpoint)) == as_bytes(state(0))
    assert as_bytes(load_safetensors(target, path)) == as_bytes(state(2))


def saving_while_opening(monkeypatch, after_first_shard):
    """Calls `after_first_shard()` once, after `open_safetensors` has read the header of
    the first shard of an index, and before it reads the others."""
    header = checkpoint_module.read_header
    calls = []

    def read_header(file):
        found = header(file)
        if not calls and SHARD.fullmatch(file.name):
            calls.append(file)
            after_first_shard()
        return found

    monkeypatch.setattr(checkpoint_module, "read_header", read_header)
    return calls


def test_an_index_replaced_while_its_shards_are_opened_is_opened_again(tmp_path, monkeypatch):
    # the saves reuse the first save's shard names (Hugging Face's, free again after the
    # second save): without a check, the opening would take shard 1 of state 0 and the
    # rest of state 2
    path = tmp_path / "model.safetensors"
    first = [p.name for p in save(path, 0, "4 shards")]
    saves = [lambda: save(path, 1, "4 shards"), lambda: save(path, 2, "4 shards")]
    calls = saving_while_opening(monkeypatch, lambda: [s() for s in saves])
    checkpoint = open_safetensors(path)
    assert calls and sorted(p.name for p in tmp_path.iterdir()) == sorted(first)
    assert as_bytes({n: t.read() for n, t in checkpoint.items()}) == as_bytes(state(2))


@pytest.mark.parametrize("after", ["one file", "6 shards"])
def test_shards_removed_while_they_are_opened_send_it_back_to_the_path(
    tmp_path, monkeypatch, after
):
    path = tmp_path / "model.safetensors"
    save(path, 0, "4 shards")
    calls = saving_while_opening(monkeypatch, lambda: save(path, 1, after))
    for opened in (lambda: open_safetensors(path), lambda: open_safetensors(tmp_path)):
        calls.clear()
        save(path, 0, "4 shards")
        checkpoint = opened()
        assert calls
        assert as_bytes({n: t.read() for n, t in checkpoint.items()}) == as_bytes(state(1))


def test_a_checkpoint_replaced_at_every_opening_is_refused_after_the_retries(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    save(path, 0, "4 shards")
    header = checkpoint_module.read_header
    saves = []

    def read_header(file):
        found = header(file)
        if SHARD.fullmatch(file.name):
            saves.append(save(path, len(saves) % 2, "4 shards"))
        return found

    monkeypatch.setattr(checkpoint_module, "read_header", read_header)
    with pytest.raises(
        SafetensorsError, match=r"model\.safetensors: the checkpoint was replaced 20 times while"
    ):
        open_safetensors(path)
    assert len(saves) == 20  # one save at each opening's first shard


def test_a_shard_missing_from_an_index_that_stays_is_an_error_at_once(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    written = save(path, 0, "4 shards")
    written[2].unlink()
    resolved = []
    resolve = checkpoint_module._resolve
    monkeypatch.setattr(checkpoint_module, "_resolve", lambda p: resolved.append(p) or resolve(p))
    with pytest.raises(
        SafetensorsError,
        match=rf"index\.json: the shard '{written[2].name}' \(of 'w4'\) is missing",
    ):
        open_safetensors(path)
    assert len(resolved) == 1  # not opened again: the index is the same file
