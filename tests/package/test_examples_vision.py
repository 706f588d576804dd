"""The vision examples: each runs to its end and proves its conversion against transformers."""

import pytest
from test_examples import parity_reports, run_example

# (about 19 s each: `make property` runs them, keeping `make test` under 12 minutes; in
# `make test`, tests/convert/test_hf_corpus.py loads both models' transformers checkpoints
# with these examples' rules and checks their outputs)
pytestmark = [pytest.mark.program, pytest.mark.thorough]


def test_vit_example_matches_transformers_and_exports_back():
    out = run_example("vit.py")
    reports = parity_reports(out)
    assert list(reports) == [
        "Taktiny against transformers:",
        "exported back through save_safetensors into ViTModel.from_pretrained:",
    ], out
    for errors in reports.values():
        assert errors.keys() == {"last_hidden_state", "pooler_output"}, out
        assert max(errors.values()) <= 1e-5, errors
    assert "[2, 17, 64]" in out  # the class token and 4 x 4 patches of 8 x 8 pixels


def test_resnet_example_matches_transformers_and_exports_back():
    out = run_example("resnet.py")
    reports = parity_reports(out)
    assert list(reports) == [
        "Taktiny against transformers (basic):",
        "exported back into a fresh ResNetModel (basic, strict=True):",
        "Taktiny against transformers (bottleneck):",
        "exported back into a fresh ResNetModel (bottleneck, strict=True):",
    ], out
    for errors in reports.values():
        assert errors.keys() == {"last_hidden_state", "pooler_output"}, out
        assert max(errors.values()) <= 1e-4, errors
    # 32 x 48 pixels, halved by the stem, the max pool and two stages: 2 x 3, channels last
    assert "[2, 2, 3, 64]" in out and "[2, 2, 3, 128]" in out, out
