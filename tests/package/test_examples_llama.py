"""The Llama example: runs to its end, proves its conversion against transformers (tied and
untied output projection, and its layers scanned as one nn.Stack) and decodes greedily with
the cache (stacked, for the scanned model) to generate's tokens; loads an FP8 block-scaled
checkpoint, and exports its int4 model as compressed-tensors for transformers and back."""

import ast

import pytest
from test_examples import parity_reports, run_example

pytestmark = pytest.mark.program


def greedy_runs(out: str) -> dict[str, dict[str, object]]:
    """{the header line: {"Taktiny": tokens, "generate": tokens, "equal": text, "traces": n}}
    for every greedy decoding the example printed."""
    lines = out.splitlines()
    runs = {}
    for i, line in enumerate(lines):
        if line.startswith("greedy decoding"):
            ours, theirs, equal, traced = lines[i + 1 : i + 5]
            runs[line] = {
                "Taktiny": ast.literal_eval(ours.split("Taktiny:")[1].strip()),
                "generate": ast.literal_eval(theirs.split("generate:")[1].strip()),
                "equal": equal.strip(),
                "traces": traced.split("traced")[1].split()[0],
                "steps": traced.split(" for ")[1],
            }
    return runs


# 23 s: `make property` runs it; the Decoder it builds, and its FP8 and compressed-tensors
# loads, are checked in `make test` by tests/models (test_decoder.py, test_pretrained.py)
@pytest.mark.thorough
def test_llama_example_matches_transformers_exports_back_and_decodes_as_generate():
    out = run_example("llama.py")
    reports = parity_reports(out)
    assert list(reports) == [
        "Taktiny against transformers (tied):",
        "exported back through save_safetensors into from_pretrained (tied):",
        "Taktiny against transformers (untied):",
        "exported back through save_safetensors into from_pretrained (untied):",
        "Taktiny against transformers (tied, scanned):",
        "exported back through save_safetensors into from_pretrained (tied, scanned):",
        # an FP8 block-scaled checkpoint, against the weights PyTorch DCP dequantizes
        "FP8 blocks: Taktiny against transformers with DCP's dequantized weights:",
        # int4 as compressed-tensors, which transformers decompresses to Taktiny's weights
        "int4 exported as compressed-tensors, against transformers loading it:",
    ], out
    for header, errors in reports.items():
        assert errors.keys() == {"logits"}, out
        # the scanned model: its layers one nn.Stack, loaded straight from the folder
        exact = "scanned" in header or "compressed-tensors" in header
        assert errors["logits"] <= (1e-5 if exact else 1e-4), errors
    assert "int4 loaded back from compressed-tensors, bit for bit: True" in out.splitlines(), out

    runs = greedy_runs(out)
    assert list(runs) == [
        "greedy decoding (tied), 20 tokens after a prompt of 7:",
        "greedy decoding (untied), 20 tokens after a prompt of 7:",
        "greedy decoding (tied, scanned), 20 tokens after a prompt of 7:",
    ], out
    for header, run in runs.items():
        ours, theirs = run["Taktiny"], run["generate"]
        assert isinstance(ours, list) and isinstance(theirs, list)
        assert [len(row) for row in theirs] == [20, 20], header  # generate did not stop early
        assert ours == theirs, header
        assert run["equal"] == "equal: True", header
        assert len({t for row in ours for t in row}) > 2, header  # not one token repeated
        # the prompt compiles its own call; every one-token step shares one compile
        assert (run["traces"], run["steps"]) == ("1", "19 steps"), header
