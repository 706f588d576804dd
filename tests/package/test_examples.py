"""The examples are what `make demo` runs; they must run to their end."""

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from _child import cpu_environment

pytestmark = pytest.mark.program

ROOT = Path(__file__).resolve().parents[2]


def run_example(name: str) -> str:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
        env=cpu_environment(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_quickstart_runs_to_its_end():
    out = run_example("quickstart.py")
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) >= 5 and losses[-1] < losses[0] / 10
    assert "restored model predicts identically: True" in out
    assert "partially loaded the trained `input` layer" in out
    assert "input.kernel    (32, 64)    float32       8192" in out
    assert "total parameters: 2,372" in out


def parity_reports(out: str) -> dict[str, dict[str, float]]:
    """{the line before it: {output: max abs error}} for every `convert.parity` report printed."""
    lines = out.splitlines()
    return {
        lines[i - 1]: {
            row.split()[0]: float(row.split()[-1])
            for row in itertools.takewhile(lambda row: row.startswith("  "), lines[i + 1 :])
        }
        for i, line in enumerate(lines)
        if line.startswith("Parity of ")
    }


# 23 s: `make property` runs it; the Encoder it builds is taktiny.models', which
# tests/models/test_encoder.py checks against transformers in `make test`
@pytest.mark.thorough
def test_bert_example_matches_transformers_and_exports_back():
    out = run_example("bert.py")
    reports = parity_reports(out)
    assert list(reports) == [
        "Taktiny against transformers:",
        "exported back into a fresh BertModel (strict=True):",
        "Taktiny against transformers (scanned):",
        "exported back through save_safetensors into BertModel.from_pretrained (scanned):",
    ], out
    for errors in reports.values():
        assert errors.keys() == {"last_hidden_state", "pooler_output"}, out
        assert max(errors.values()) <= 1e-5, errors
    # the scanned model (its layers one nn.Stack) read per layer is the unrolled one
    assert "scanned per-layer state equals the unrolled model's, bit for bit: True" in out, out
    moved = float(out.split("hidden states move by")[1].splitlines()[0])
    assert moved > 0.01  # dropout with a key changes the output
    # the same key drops the same activations in both: each layer gets the same key
    apart = float(out.split("scanned and unrolled differ by at most")[1].splitlines()[0])
    assert apart <= 1e-5, out


@pytest.mark.thorough  # (22 s: `make property` runs it; tests/convert/test_hf_corpus.py's
def test_gpt2_example_matches_transformers_and_exports_back():  # GPT-2 runs in `make test`)
    out = run_example("gpt2.py")
    reports = parity_reports(out)
    assert list(reports) == [
        "Taktiny against transformers:",
        "exported back through save_safetensors into GPT2LMHeadModel.from_pretrained:",
    ], out
    for errors in reports.values():
        assert errors.keys() == {"logits"}, out
        assert errors["logits"] <= 1e-5, errors
    assert "causal: earlier positions do not see later tokens" in out


@pytest.mark.thorough  # (10 s: `make property` runs it; tests/nn/test_batchnorm.py checks the
# layer, its running statistics and their training mode in `make test`)
def test_batchnorm_example_trains_through_nested_layers():
    out = run_example("batchnorm.py")
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) == 5 and losses[-1] < losses[0] / 10
    assert "256 not trained" in out
    means = out.split("running mean, first 3: [")[1].split("]")[0].split()
    assert any(abs(float(m)) > 0.5 for m in means)  # the deep BatchNorm tracked its input


def test_distributed_example_saves_and_restores_onto_another_mesh_in_one_process():
    # with no arguments, one process of 8 simulated CPU devices; tests/loading/test_multiprocess.py
    # runs the same program as 2 processes
    out = run_example("distributed.py")
    assert "process 0 of 1: 8 of 8 devices" in out
    assert (
        "process 0: 16 leaves restored bitwise equal (128 shards) on mesh {'data': 4, 'model': 2}"
        in out
    )
    assert len([line for line in out.splitlines() if " loss " in line]) == 2  # saved, resumed
