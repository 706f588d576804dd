"""Readers racing saves of larger checkpoints (2 MiB, so that each read takes long enough
to span a save's commit): every read, by the path, by its folder or by a load, gives
bitwise one of the two states saved in turn. tests/_race.py is the harness;
tests/io/test_race.py races small checkpoints. ``make test`` races for 2 seconds, ``make
property`` for 20."""

import pytest

from property_tests.budget import examples
from tests._race import race


@pytest.mark.program
def test_reads_racing_saves_of_large_checkpoints_give_one_whole_state(tmp_path):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    seconds = examples(2)
    counts = race(folder, seconds=float(seconds), scale=32, reads=10 * seconds)
    print(f"reads racing saves of 2 MiB for {seconds} s: {counts}")
    assert counts["errors"] == 0 and counts["wrong"] == 0, counts["problems"]
    assert counts["reads"] >= 10 * seconds and counts["saves"] >= seconds, counts
    assert counts["overlapping"] >= counts["reads"] // 2, counts
