"""tt.summary: a table of names, shapes, dtypes, shardings and trainability, with totals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import MLP
from jax.sharding import NamedSharding, PartitionSpec

import taktiny as tt
from taktiny import nn


def cpus():
    """The 8 simulated devices of conftest.py: CPU devices, also where the default backend
    is a GPU with one device."""
    return jax.devices("cpu")


def on_default():
    """How a summary names a leaf on the default device: "cpu:0" here, "gpu:0" on a GPU."""
    device = jax.devices()[0]
    return f"{device.platform}:{device.id}"


class Net(nn.Module):
    def __init__(self, *, rngs):
        self.mlp = MLP(rngs=rngs)
        self.norm = nn.BatchNorm(4, param_dtype=jnp.bfloat16)


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
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=cpus())
    model = MLP(rngs=nn.Rngs(0))
    kernel = jax.device_put(model.input.kernel, NamedSharding(mesh, PartitionSpec(None, "model")))
    text = str(tt.summary(model.replace(input=model.input.replace(kernel=kernel))))
    lines = text.splitlines()
    assert lines[2].split() == ["name", "shape", "dtype", "sharding", "train", "params", "bytes"]
    assert lines[4].split()[:6] == ["input.kernel", "(32,", "64)", "float32", "P(None,", "'model')"]
    assert on_default() in lines[5]
    assert "sharding" not in str(tt.summary(model))


def test_summary_repr_is_its_table():
    summary = tt.summary(MLP(rngs=nn.Rngs(0)))
    assert repr(summary) == str(summary) and str(summary).startswith("MLP summary\n---")


def _mesh(n):
    return jax.sharding.Mesh(np.array(cpus()[:n]), ("model",))


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_a_leaf_is_sharded_when_it_spans_more_than_one_device(devices):
    kernel = jax.device_put(jnp.ones((8, 2)), NamedSharding(_mesh(devices), PartitionSpec("model")))
    summary = tt.summary({"kernel": kernel})
    assert summary.rows[0].sharding == "P('model',)"
    assert summary.sharded == (devices > 1)
    assert ("sharding" in str(summary).splitlines()[2]) == (devices > 1)


def test_a_sharding_without_a_partition_spec_is_named_by_its_type():
    # JAX's GSPMDSharding has no PartitionSpec (public through jax.extend, for libraries)
    from jax.extend.sharding import GSPMDSharding

    replicated = jax.device_put(jnp.ones(3), GSPMDSharding.get_replicated(cpus()))
    summary = tt.summary({"w": replicated, "b": jnp.ones(2)})
    assert [(r.name, r.sharding) for r in summary.rows] == [
        ("b", on_default()),
        ("w", "GSPMDSharding"),
    ]
    assert summary.sharded
    assert str(summary).splitlines()[2].split()[3] == "sharding"


def test_plain_python_and_numpy_leaves_are_described_as_numpy_sees_them():
    tree = {"lr": 0.5, "steps": 3, "table": np.zeros((2, 3), np.float16)}
    summary = tt.summary(tree)
    assert [(r.name, r.shape, r.dtype, r.sharding, r.size, r.nbytes) for r in summary.rows] == [
        (name, np.shape(v), np.asarray(v).dtype.name, "", np.size(v), np.asarray(v).nbytes)
        for name, v in tree.items()
    ]
    assert not summary.sharded and "sharding" not in str(summary)


def test_depth_groups_names_by_their_first_parts():
    # a group's row: no shape, its dtypes in order, "mixed" trainability, summed sizes; a leaf
    # whose whole name is within `depth` parts keeps its own row
    tree = {
        "head": {"w": jnp.ones((4, 2))},
        "net": Net(rngs=nn.Rngs(0)),
        "step": jnp.zeros((), jnp.int32),
    }
    head_w = ("head.w", (4, 2), "float32", True, 8, 32)
    step = ("step", (), "int32", False, 1, 4)  # an integer: not trained
    norm = [
        (f"net.norm.{name}", (4,), "bfloat16", trained, 4, 8)
        for name, trained in [("scale", True), ("bias", True), ("mean", False), ("var", False)]
    ]
    expected = {
        1: [
            ("head", None, "float32", True, 8, 32),
            ("net", None, "float32/bfloat16", None, 2388, 4 * 2372 + 2 * 16),
            step,
        ],
        2: [
            head_w,
            ("net.mlp", None, "float32", True, 2372, 4 * 2372),
            ("net.norm", None, "bfloat16", None, 16, 32),
            step,
        ],
        3: [
            head_w,
            ("net.mlp.input", None, "float32", True, 32 * 64 + 64, 4 * (32 * 64 + 64)),
            ("net.mlp.output", None, "float32", True, 64 * 4 + 4, 4 * (64 * 4 + 4)),
            *norm,
            step,
        ],
    }
    for depth, rows in expected.items():
        summary = tt.summary(tree, depth=depth)
        got = [(r.name, r.shape, r.dtype, r.trainable, r.size, r.nbytes) for r in summary.rows]
        assert got == rows, depth
        assert (summary.params, summary.trainable_params) == (8 + 2388 + 1, 8 + 2380)
    lines = str(tt.summary(tree, depth=1)).splitlines()
    assert [line.split() for line in lines[4:7]] == [
        ["head", "float32", "yes", "8", "32", "B"],
        ["net", "float32/bfloat16", "mixed", "2,388", "9.3", "KiB"],
        ["step", "()", "int32", "no", "1", "4", "B"],
    ]


def test_a_group_shows_its_placement_or_mixed():
    model = MLP(rngs=nn.Rngs(0))
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=cpus())
    kernel = jax.device_put(model.input.kernel, NamedSharding(mesh, PartitionSpec(None, "model")))
    summary = tt.summary(model.replace(input=model.input.replace(kernel=kernel)), depth=1)
    assert [(r.name, r.sharding) for r in summary.rows] == [
        ("input", "mixed"),
        ("output", on_default()),
    ]
    lines = str(summary).splitlines()
    assert lines[2].split()[3] == "sharding"
    assert lines[4].split()[:3] == ["input", "float32", "mixed"]
    assert lines[5].split()[:3] == ["output", "float32", on_default()]


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (2**20 - 1, "1024.0 KiB"),
        (2**20, "1.0 MiB"),
        (3 * 2**19, "1.5 MiB"),
        (2**30 - 1, "1024.0 MiB"),
        (2**30, "1.0 GiB"),
        (5 * 2**29, "2.5 GiB"),
    ],
)
def test_byte_counts_are_shown_in_binary_units_from_one_unit_up(nbytes, text):
    # abstract leaves: a GiB of uint8 costs nothing
    summary = tt.summary({"buffer": jax.ShapeDtypeStruct((nbytes,), jnp.uint8)})
    assert summary.nbytes == nbytes
    lines = str(summary).splitlines()
    assert lines[4].endswith(f"  {text}")
    assert lines[-1] == f"{nbytes:,} parameters ({text}): 0 trainable, {nbytes:,} not trained"


class Tied(nn.Module):
    def __init__(self, *, rngs):
        self.embed = nn.Embed(32, 16, rngs=rngs)
        self.proj = nn.Linear(16, 8, rngs=rngs)


def test_a_quantized_weight_fills_every_column_and_is_not_trained():
    """A group that is one quantized weight (its value and scale) is that weight's row:
    its logical shape, both dtypes, its value's placement; neither part is trained."""
    model = tt.quantize(Tied(rngs=nn.Rngs(0)), bits=4, group_size=4)
    summary = tt.summary(model, depth=2)
    assert [(r.name, r.shape, r.dtype, r.trainable, r.size, r.nbytes) for r in summary.rows] == [
        ("embed.embedding", (32, 16), "int4/float32", False, 32 * 16 + 32 * 4, 256 + 512),
        ("proj.kernel", (16, 8), "int4/float32", False, 16 * 8 + 4 * 8, 64 + 128),
        ("proj.bias", (8,), "float32", True, 8, 32),
    ]
    assert str(summary).splitlines()[4].split()[:5] == [
        "embed.embedding", "(32,", "16)", "int4/float32", "no",
    ]  # fmt: skip
    assert summary.trainable_params == tt.summary(model).trainable_params == 8  # the bias
    # split: the value's spec (its rule's), though the scale's groups are not split
    mesh = jax.make_mesh((2, 4), ("data", "model"), devices=cpus())
    split = tt.shard(model, {"embed.embedding": (None, "model")}, mesh)
    assert split.embed.embedding.scale.sharding.spec == PartitionSpec(None, None)
    rows = tt.summary(split, depth=2).rows
    assert (rows[0].name, rows[0].shape, rows[0].sharding) == (
        "embed.embedding",
        (32, 16),
        "P(None, 'model')",
    )
    assert rows[1].sharding == "P()" and tt.summary(split, depth=1).rows[0].shape is None
