"""tt.summary: a table of names, shapes, dtypes, shardings and trainability, with totals."""

import jax
import jax.numpy as jnp
import pytest
from _models import MLP
from jax.sharding import NamedSharding, PartitionSpec

import taktiny as tt
from taktiny import nn


class Net(nn.Module):
    def __init__(self, *, rngs):
        self.mlp = MLP(rngs=rngs)
        self.norm = nn.BatchNorm(4, dtype=jnp.bfloat16)


def test_summary_lists_every_parameter_with_totals():
    text = str(tt.summary(Net(rngs=nn.Rngs(0))))
    assert text.splitlines() == [
        "Net summary",
        "-------------------------------------------------------------",
        "name               shape     dtype     train  params    bytes",
        "-------------------------------------------------------------",
        "mlp.input.kernel   (32, 64)  float32   yes     2,048  8.0 KiB",
        "mlp.input.bias     (64,)     float32   yes        64    256 B",
        "mlp.output.kernel  (64, 4)   float32   yes       256  1.0 KiB",
        "mlp.output.bias    (4,)      float32   yes         4     16 B",
        "norm.scale         (4,)      bfloat16  yes         4      8 B",
        "norm.bias          (4,)      bfloat16  yes         4      8 B",
        "norm.mean          (4,)      bfloat16  no          4      8 B",
        "norm.var           (4,)      bfloat16  no          4      8 B",
        "-------------------------------------------------------------",
        "2,388 parameters (9.3 KiB): 2,380 trainable, 8 not trained",
    ]


def test_summary_totals_groups_and_abstract_models():
    model = Net(rngs=nn.Rngs(0))
    full = tt.summary(model)
    assert (full.params, full.trainable_params) == (2388, 2380)
    assert full.nbytes == 4 * 2372 + 2 * 16
    abstract = tt.summary(jax.eval_shape(lambda: Net(rngs=nn.Rngs(0))))
    assert str(abstract) == str(full) and abstract.params == full.params
    grouped = tt.summary(model, depth=1)
    assert [(r.name, r.size, r.trainable) for r in grouped.rows] == [
        ("mlp", 2372, True),
        ("norm", 16, None),
    ]
    assert str(grouped).splitlines()[4:6] == [
        "mlp          float32   yes     2,372  9.3 KiB",
        "norm         bfloat16  mixed      16     32 B",
    ]
    assert grouped.trainable_params == 2380
    with pytest.raises(ValueError, match=r"summary's depth counts name parts, so it is >= 1"):
        tt.summary(model, depth=0)


def test_summary_shows_shardings_when_sharded():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    model = MLP(rngs=nn.Rngs(0))
    kernel = jax.device_put(model.input.kernel, NamedSharding(mesh, PartitionSpec(None, "model")))
    text = str(tt.summary(model.replace(input=model.input.replace(kernel=kernel))))
    lines = text.splitlines()
    assert lines[2].split() == ["name", "shape", "dtype", "sharding", "train", "params", "bytes"]
    assert lines[4].split()[:6] == ["input.kernel", "(32,", "64)", "float32", "P(None,", "'model')"]
    assert "cpu:0" in lines[5]
    assert "sharding" not in str(tt.summary(model))


def test_summary_repr_is_its_table():
    summary = tt.summary(MLP(rngs=nn.Rngs(0)))
    assert repr(summary) == str(summary) and str(summary).startswith("MLP summary\n---")
