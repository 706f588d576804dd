"""Probe: FP8 block product on the default device vs NumPy (float32 product, rounded to bf16)."""
import jax, jax.numpy as jnp, numpy as np, ml_dtypes
from taktiny.quant._fp8 import placed_blocks, _product
rng = np.random.default_rng(0)
w = (rng.standard_normal((256, 256)) * 3).astype(np.float32)
blocks = w.reshape(2, 128, 2, 128)
scale = (np.abs(blocks).max(axis=(1, 3)) / 448).astype(np.float32)
full = np.repeat(np.repeat(scale, 128, 0), 128, 1)
weight = (w / full).astype(ml_dtypes.float8_e4m3fn)
want32 = weight.astype(np.float32) * full
want = want32.astype(ml_dtypes.bfloat16)
dev = jax.devices()[0]
got = np.asarray(placed_blocks(jax.device_put(weight, dev), jax.device_put(scale, dev), (128, 128), jnp.bfloat16, None, 0, None))
got32 = np.asarray(jax.jit(lambda v, s: _product(v, s, (128, 128)))(jax.device_put(weight, dev), jax.device_put(scale, dev)))
bad = np.nonzero(got.view(np.uint16) != want.view(np.uint16))
print(dev.platform, "bf16 mismatches", bad[0].size, "of", got.size, "f32 product mismatches", int((got32.view(np.uint32) != want32.view(np.uint32)).sum()))
for i, j in list(zip(*bad))[:5]:
    print(" w8", weight[i, j], "scale", full[i, j], "np32", want32[i, j].hex() if hasattr(want32[i,j],'hex') else float(want32[i, j]).hex(), "dev32", float(got32[i, j]).hex(), "np bf16", float(want[i, j]), "dev bf16", float(got[i, j]))
direct = np.asarray(jax.jit(lambda x: x.astype(jnp.bfloat16))(jax.device_put(want32, dev)))
print("f32->bf16 convert mismatches", int((direct.view(np.uint16) != want.view(np.uint16)).sum()))
