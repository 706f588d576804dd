"""Helpers for the oracle tests: PyTorch modules in, NumPy arrays out, one error budget."""

import jax
import numpy as np
import torch

torch.set_num_threads(1)  # the machine's cores are shared; the oracles are tiny

TOLERANCE = 1e-5  # max abs error allowed against PyTorch in float32


def numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def channels_last(t: torch.Tensor) -> np.ndarray:
    """[N, C, *spatial] (PyTorch's layout) -> [N, *spatial, C] (Taktiny's)."""
    return numpy(t.movedim(1, -1))


def randomize_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Gives every parameter and floating buffer of `module` random values in place
    (PyTorch's own init leaves biases small and norms at ones/zeros, which hides bugs)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if not tensor.is_floating_point():
                continue
            values = torch.randn(tensor.shape, generator=generator) * 0.5
            if name.endswith("running_var"):
                values = values.abs() + 0.5  # a variance is positive
            tensor.copy_(values)
    return module.eval()


def assert_close(ours, theirs, tolerance: float = TOLERANCE) -> float:
    """Asserts max |ours - theirs| <= tolerance (shapes equal) and returns the error."""
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    assert np.isfinite(ours).all() and np.isfinite(theirs).all()
    error = float(np.max(np.abs(ours.astype(np.float64) - theirs))) if ours.size else 0.0
    print(f"max abs error {error:.2e}")
    assert error <= tolerance, f"max abs error {error:.3g} > {tolerance:g}"
    return error


def build(factory, state):
    """The layer `factory()` builds, with `state` loaded: built abstractly (no random
    initialisation to compile) and filled by a strict load, which must supply every
    parameter."""
    return jax.eval_shape(factory).load_flat_state_dict(state, strict=True)
