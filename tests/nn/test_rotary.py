"""RotaryEmbedding against Hugging Face's Llama rotary embedding, and MultiHeadAttention with
rotary embeddings and grouped key/value heads against Hugging Face's LlamaAttention."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _torch import assert_close, build, numpy, randomize_
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from taktiny import nn


def llama_config(theta, *, hidden=32, heads=4, kv_heads=2, head_dim=8, bias=False):
    config = LlamaConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        attention_bias=bias,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
    )
    config._attn_implementation = "eager"
    return config


def randn(*shape, seed):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


@pytest.mark.parametrize(
    ("theta", "head_dim"), [(10000.0, 8), (500000.0, 64), (100.0, 2), (10000.0, 80), (1e6, 96)]
)
def test_rotation_matches_hugging_face_llama(theta, head_dim):
    config = llama_config(theta, heads=3, kv_heads=3, head_dim=head_dim, hidden=3 * head_dim)
    q, k = randn(2, 6, 3, head_dim, seed=0), randn(2, 6, 3, head_dim, seed=1)
    positions = np.random.default_rng(2).integers(0, 2000, size=(2, 6))
    ids = torch.from_numpy(positions)
    cos, sin = LlamaRotaryEmbedding(config)(torch.from_numpy(q), ids)
    # Hugging Face's layout is [batch, heads, length, head_dim]; ours [batch, length, heads, ...]
    theirs = apply_rotary_pos_emb(
        torch.from_numpy(q), torch.from_numpy(k), cos, sin, unsqueeze_dim=2
    )
    rotary = nn.RotaryEmbedding(head_dim, theta=theta)
    ids = jnp.asarray(positions, jnp.int32)
    assert_close(rotary(jnp.asarray(q), ids), numpy(theirs[0]))
    assert_close(rotary(jnp.asarray(k), ids), numpy(theirs[1]))
    assert rotary.state_dict() == {}  # no parameters


SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                    "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5},
    "yarn-untruncated": {"rope_type": "yarn", "factor": 2.0, "truncate": False,
                         "original_max_position_embeddings": 100, "attention_factor": 1.5},
}  # fmt: skip


def hugging_face_rotation(scaling, theta, head_dim, positions, q, *, max_positions=4096):
    config = llama_config(theta, heads=3, kv_heads=3, head_dim=head_dim, hidden=3 * head_dim)
    config.rope_parameters = {**scaling, "rope_theta": theta}
    config.max_position_embeddings = max_positions
    cos, sin = LlamaRotaryEmbedding(config)(torch.from_numpy(q), torch.from_numpy(positions))
    q = torch.from_numpy(q)
    return numpy(apply_rotary_pos_emb(q, q, cos, sin, unsqueeze_dim=2)[0])


@pytest.mark.parametrize("kind", list(SCALINGS))
@pytest.mark.parametrize(("theta", "head_dim"), [(10000.0, 16), (500000.0, 64)])
def test_scaled_rotations_match_hugging_face(kind, theta, head_dim):
    q = randn(2, 6, 3, head_dim, seed=0)
    positions = np.random.default_rng(2).integers(0, 2000, size=(2, 6))
    theirs = hugging_face_rotation(SCALINGS[kind], theta, head_dim, positions, q)
    rotary = nn.RotaryEmbedding(
        head_dim, theta=theta, scaling={**SCALINGS[kind], "rope_theta": theta}
    )
    assert_close(rotary(jnp.asarray(q), jnp.asarray(positions, jnp.int32)), theirs)
    plain = nn.RotaryEmbedding(head_dim, theta=theta)(jnp.asarray(q), jnp.asarray(positions))
    assert np.abs(np.asarray(plain) - theirs).max() > 1e-2  # the scaling changes the rotation


# Configurations at the edges of the formulas, each against transformers
EDGES = {
    # a trained context of 4096, as real models have: the ramp starts past dimension 0, where
    # beta_fast and beta_slow place it, and mscale alone (no mscale_all_dim) sets the factor
    "yarn-4096": (10000.0, 64, {"rope_type": "yarn", "factor": 4.0, "beta_fast": 24.0,
                                "beta_slow": 2.0, "mscale": 0.8,
                                "original_max_position_embeddings": 4096}),
    # the default betas untruncated, and factor 2 with no attention factor given
    "yarn-defaults": (10000.0, 128, {"rope_type": "yarn", "factor": 2.0, "truncate": False,
                                     "original_max_position_embeddings": 4096}),
    # a context so short that both ends of the ramp fall on dimension 0 (transformers then
    # moves the upper one by 0.001)
    "yarn-ends-meet": (10000.0, 16, {"rope_type": "yarn", "factor": 4.0,
                                     "original_max_position_embeddings": 6}),
    # the upper end past the last dimension, clipped to head_dim - 1
    "yarn-clipped": (100.0, 16, {"rope_type": "yarn", "factor": 4.0, "beta_fast": 128.0,
                                 "beta_slow": 1.0, "original_max_position_embeddings": 40000}),
    "llama3-low-2": (10000.0, 64, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}),
    # the first wavelength (2 pi) exactly at context / low_freq_factor: smoothed, not divided
    "llama3-at-the-edge": (10000.0, 16, {"rope_type": "llama3", "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings":
                                             float(np.float32(2 * np.pi))}),
    # factor 1: nothing interpolated and an attention factor of 1, the plain rotation
    "yarn-factor-1": (10000.0, 16, {"rope_type": "yarn", "factor": 1.0,
                                    "original_max_position_embeddings": 64}),
    # an attention factor of exactly 2 given: the cosines and sines doubled
    "yarn-attention-2": (10000.0, 16, {"rope_type": "yarn", "factor": 4.0,
                                       "original_max_position_embeddings": 64,
                                       "attention_factor": 2.0}),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(EDGES))
def test_scalings_at_the_edges_of_their_formulas_match_hugging_face(kind):
    theta, head_dim, scaling = EDGES[kind]
    q = randn(2, 6, 3, head_dim, seed=0)
    positions = np.random.default_rng(2).integers(0, 2000, size=(2, 6))
    theirs = hugging_face_rotation(scaling, theta, head_dim, positions, q)
    rotary = nn.RotaryEmbedding(head_dim, theta=theta, scaling=scaling)
    ours = rotary(jnp.asarray(q), jnp.asarray(positions, jnp.int32))
    assert_close(ours, theirs)
    plain = nn.RotaryEmbedding(head_dim, theta=theta)(jnp.asarray(q), jnp.asarray(positions))
    if kind == "yarn-factor-1":
        assert_close(plain, theirs)


def test_the_frequencies_are_float32_whatever_the_scaling_even_with_x64():
    with jax.enable_x64(True):
        for scaling in [*SCALINGS.values(), *(edge[2] for edge in EDGES.values())]:
            assert nn.RotaryEmbedding(16, scaling=scaling).inv_freq().dtype == jnp.float32


@pytest.mark.parametrize("length", [40, 100])  # within, then past the trained 64 positions
def test_dynamic_scaling_matches_hugging_face_over_a_whole_sequence(length):
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    q = randn(1, length, 3, 16, seed=0)
    positions = np.arange(length)[None]
    theirs = hugging_face_rotation(scaling, 10000.0, 16, positions, q, max_positions=64)
    rotary = nn.RotaryEmbedding(16, scaling={**scaling, "max_position_embeddings": 64})
    assert_close(rotary(jnp.asarray(q), jnp.asarray(positions)), theirs)
    plain = nn.RotaryEmbedding(16)(jnp.asarray(q), jnp.asarray(positions))
    assert (np.abs(np.asarray(plain) - theirs).max() > 1e-2) == (length > 64)


SCALING_ERRORS = [
    ({"rope_type": "longrope", "factor": 2.0},
     "RotaryEmbedding's scaling has rope_type 'longrope'; the kinds it computes are "
     "['default', 'linear', 'dynamic', 'llama3', 'yarn']."),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq": 1.0},
     "RotaryEmbedding's 'llama3' scaling {'rope_type': 'llama3', 'factor': 8.0, 'low_freq': "
     "1.0}: it lacks ['low_freq_factor', 'high_freq_factor', "
     "'original_max_position_embeddings']; ['low_freq'] are not among its parameters "
     "['factor', 'low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings']."),
    ({"type": "linear", "factor": 0.5, "rope_theta": 500.0},
     "RotaryEmbedding's 'linear' scaling {'type': 'linear', 'factor': 0.5, 'rope_theta': 500.0}: "
     "its rope_theta 500.0 is not theta (10000.0); its factor must be at least 1, got 0.5."),
    ({"rope_type": "default", "partial_rotary_factor": 0.5},
     "RotaryEmbedding's 'default' scaling {'rope_type': 'default', 'partial_rotary_factor': "
     "0.5}: a partial_rotary_factor other than 1.0 is not supported."),
    ([("rope_type", "linear")],
     "RotaryEmbedding's scaling is a dict as Hugging Face's rope_parameters (or rope_scaling) "
     "holds it, such as {'rope_type': 'linear', 'factor': 4.0}, got [('rope_type', 'linear')]."),
]  # fmt: skip


@pytest.mark.parametrize("scaling, message", SCALING_ERRORS)
def test_a_scaling_it_cannot_compute_is_refused_naming_what_is_wrong(
    scaling, message, without_type_checks
):
    with pytest.raises(ValueError) as info:
        nn.RotaryEmbedding(8, scaling=scaling)
    assert str(info.value) == message


def test_a_scaling_is_configuration_shown_in_the_repr_and_taken_by_attention():
    rotary = nn.RotaryEmbedding(8, scaling={"rope_type": "linear", "factor": 2.0})
    assert rotary.state_dict() == {} and "('factor', 2.0)" in repr(rotary)
    assert (
        nn.RotaryEmbedding(8, scaling={"rope_type": "default", "rope_theta": 10000.0}).scaling == ()
    )
    attention = nn.MultiHeadAttention(2, 16, rope_theta=100.0, rope_scaling={"type": "linear", "factor": 2.0},
                                      rngs=nn.Rngs(0))  # fmt: skip
    assert attention.rotary is not None and attention.rotary.scaling == (
        ("rope_type", "linear"), ("factor", 2.0))  # fmt: skip
    with pytest.raises(ValueError, match=r"got rope_scaling without rope_theta: scaling stretch"):
        nn.MultiHeadAttention(
            2, 16, rope_scaling={"type": "linear", "factor": 2.0}, rngs=nn.Rngs(0)
        )


def test_a_scaling_without_a_kind_is_the_plain_rotation():
    """A dict with neither "rope_type" nor rope_scaling's older "type" (rope_parameters that
    only hold rope_theta) is the default, no scaling, as transformers' config reads it."""
    assert LlamaConfig(rope_parameters={"rope_theta": 500000.0}).rope_parameters == {
        "rope_theta": 500000.0, "rope_type": "default"}  # fmt: skip
    q = randn(2, 6, 3, 16, seed=0)
    positions = np.random.default_rng(2).integers(0, 2000, size=(2, 6))
    theirs = hugging_face_rotation({"rope_type": "default"}, 500000.0, 16, positions, q)
    for scaling in ({"rope_theta": 500000.0}, {}, {"partial_rotary_factor": 1.0}):
        rotary = nn.RotaryEmbedding(16, theta=500000.0, scaling=scaling)
        assert rotary.scaling == (), scaling
        assert_close(rotary(jnp.asarray(q), jnp.asarray(positions, jnp.int32)), theirs)


def test_a_partial_rotary_factor_of_1_is_no_parameter_of_the_scaling():
    """transformers 5 may write partial_rotary_factor 1.0 (every feature rotated) into
    rope_parameters: the layer is the one built without it (the same configuration, repr
    and tree structure, so a jitted call does not trace it again)."""
    linear = {"rope_type": "linear", "factor": 2.0}
    given = nn.RotaryEmbedding(8, scaling={**linear, "partial_rotary_factor": 1.0})
    plain = nn.RotaryEmbedding(8, scaling=linear)
    assert given.scaling == (("rope_type", "linear"), ("factor", 2.0))
    assert repr(given) == repr(plain)
    assert jax.tree.structure(given) == jax.tree.structure(plain)


def test_scores_depend_on_the_relative_position_only():
    """The point of rotary embeddings: q at position m against k at n scores as at m + s
    against n + s, and not as at other distances."""
    rotary = nn.RotaryEmbedding(16)
    q, k = jnp.asarray(randn(1, 1, 1, 16, seed=0)), jnp.asarray(randn(1, 1, 1, 16, seed=1))

    def score(m, n):
        at = lambda x, p: rotary(x, jnp.array([[p]]))
        return float(jnp.sum(at(q, m) * at(k, n)))

    assert score(3, 1) == pytest.approx(score(40, 38), abs=1e-4)
    assert score(3, 1) != pytest.approx(score(3, 2), abs=1e-2)
    assert score(0, 0) == pytest.approx(float(jnp.sum(q * k)), abs=1e-5)  # position 0: as is


def test_shared_positions_broadcast_over_the_batch_and_low_precision_keeps_its_dtype():
    rotary = nn.RotaryEmbedding(8)
    x = jnp.asarray(randn(3, 5, 2, 8, seed=0))
    tiled = jnp.broadcast_to(jnp.arange(5) + 7, (3, 5))
    assert_close(rotary(x, jnp.arange(5) + 7), rotary(x, tiled))
    half = rotary(x.astype(jnp.bfloat16), tiled)
    assert half.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(half, np.float32), rotary(x, tiled), atol=3e-2)
    assert not np.allclose(rotary(x, tiled), x, atol=1e-2)  # it does rotate


@pytest.mark.parametrize("head_dim", [0, 7])
def test_head_dim_must_be_even(head_dim):
    expected = "RotaryEmbedding's head_dim must be even and at least 2 (the features of a "
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}.*got {head_dim}; "):
        nn.RotaryEmbedding(head_dim)
    with pytest.raises(ValueError, match=r"^RotaryEmbedding's theta must be positive, got 0\.0"):
        nn.RotaryEmbedding(8, theta=0.0)


@pytest.mark.parametrize(
    ("positions", "got"),
    [
        (np.arange(4, dtype=np.int32), "int32[4]"),  # one position short
        (np.zeros((3, 5), np.int32), "int32[3, 5]"),  # another batch
        (np.arange(5, dtype=np.float32), "float32[5]"),  # not integers
        (np.zeros((1, 2, 5), np.int32), "int32[1, 2, 5]"),  # more axes than [*batch, length]
    ],
)
def test_rejects_positions_of_the_wrong_shape_or_dtype(positions, got, without_type_checks):
    x = jnp.ones((2, 5, 1, 8))
    expected = (
        f"RotaryEmbedding's positions must be integer position ids of shape [*batch, length] = "
        f"[2, 5] (or broadcastable to it, such as [5]), got {got}. Pass one integer position "
        f"per token, such as jnp.arange(5) + offset."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        nn.RotaryEmbedding(8)(x, jnp.asarray(positions))


def test_rejects_heads_of_another_size():
    with pytest.raises(
        ValueError,
        match=r"^RotaryEmbedding expects x of shape \[\*batch, length, heads, head_dim\] with "
        r"head_dim=8, got \(2, 5, 1, 6\); build it with RotaryEmbedding\(6\) for these heads\.$",
    ):
        nn.RotaryEmbedding(8)(jnp.ones((2, 5, 1, 6)), jnp.arange(5))


def convert_llama(reference):
    """Hugging Face's q/k/v/o_proj weights [out, in] -> query/key/value/out kernels [in, out]."""
    names = {"q_proj": "query", "k_proj": "key", "v_proj": "value", "o_proj": "out"}
    return {
        f"{names[module]}.{'kernel' if kind == 'weight' else 'bias'}": (
            numpy(p.T) if kind == "weight" else numpy(p)
        )
        for module, kind, p in ((*name.split("."), p) for name, p in reference.named_parameters())
    }


@pytest.mark.parametrize(
    ("heads", "kv_heads", "bias"), [(4, 2, False), (4, 1, True), (2, 2, False)]
)
def test_rotary_grouped_attention_matches_hugging_face_llama_with_left_padding(
    heads, kv_heads, bias
):
    """A left-padded batch, as generation pads prompts: positions count the valid tokens
    only, keys are masked causally and by the padding; the valid queries' outputs match."""
    config = llama_config(500.0, heads=heads, kv_heads=kv_heads, bias=bias)
    reference = randomize_(LlamaAttention(config, layer_idx=0))
    mha = build(
        lambda: nn.MultiHeadAttention(
            heads, 32, qkv_features=heads * 8, num_kv_heads=kv_heads, rope_theta=500.0,
            use_bias=bias, precision="highest", rngs=nn.Rngs(0),
        ),
        convert_llama(reference),
    )  # fmt: skip
    batch, length = 2, 7
    x = randn(batch, length, 32, seed=3)
    valid = np.ones((batch, length), bool)
    valid[1, :3] = False  # the second prompt is 3 tokens shorter
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
    allowed = np.tril(np.ones((length, length), bool)) & valid[:, None, None, :]
    additive = np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)
    ids = torch.from_numpy(positions)
    embeddings = LlamaRotaryEmbedding(config)(torch.from_numpy(x), ids)
    expected, _ = reference(
        torch.from_numpy(x),
        position_embeddings=embeddings,
        attention_mask=torch.from_numpy(additive),
    )
    ours = mha(
        jnp.asarray(x),
        mask=jnp.asarray(valid[:, None, None, :]),
        causal=True,
        positions=jnp.asarray(positions, jnp.int32),
    )
    assert_close(np.asarray(ours)[valid], numpy(expected)[valid])
    # the positions reach the rotation (shifting them all would not change a thing)
    spread = mha(
        jnp.asarray(x),
        mask=jnp.asarray(valid[:, None, None, :]),
        causal=True,
        positions=jnp.asarray(2 * positions, jnp.int32),
    )
    assert not np.allclose(np.asarray(spread)[valid], numpy(expected)[valid], atol=1e-3)


def test_positions_broadcast_over_several_batch_axes_or_none():
    """x [3, 2, 5, heads, 8]: any positions broadcastable to [3, 2, 5] rotate as the tiled
    ones do; an unbatched x [5, heads, 8] takes its [5] positions."""
    rotary = nn.RotaryEmbedding(8)
    x = jnp.asarray(randn(3, 2, 5, 2, 8, seed=0))
    at = np.random.default_rng(1).integers(0, 50, size=(3, 2, 5)).astype(np.int32)
    full = rotary(x, jnp.asarray(at))
    for i, j in [(0, 0), (2, 1)]:
        assert_close(rotary(x[i, j], jnp.asarray(at[i, j])), full[i, j])
    for shared in (at[:1], at[:, :1], at[0], at[0, 0], at[:1, :1]):
        tiled = np.broadcast_to(shared, (3, 2, 5))
        assert_close(rotary(x, jnp.asarray(shared)), rotary(x, jnp.asarray(tiled)))


def test_rejects_positions_that_do_not_broadcast_over_several_batch_axes(without_type_checks):
    expected = (
        "RotaryEmbedding's positions must be integer position ids of shape [*batch, length] = "
        "[3, 2, 5] (or broadcastable to it, such as [5]), got int32[4, 2, 5]. Pass one integer "
        "position per token, such as jnp.arange(5) + offset."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        nn.RotaryEmbedding(8)(jnp.ones((3, 2, 5, 1, 8)), jnp.zeros((4, 2, 5), jnp.int32))


@pytest.mark.parametrize(("shape", "hint"), [((), "..."), ((5, 8), "8")])
def test_rejects_inputs_without_heads(shape, hint, without_type_checks):
    expected = (
        f"RotaryEmbedding expects x of shape [*batch, length, heads, head_dim] with head_dim=8, "
        f"got {shape}; build it with RotaryEmbedding({hint}) for these heads."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        nn.RotaryEmbedding(8)(jnp.ones(shape), jnp.arange(5))


def test_theta_defaults_to_llama_2s_and_may_be_any_positive_number():
    assert nn.RotaryEmbedding(8).theta == 10000.0
    fast = nn.RotaryEmbedding(8, theta=0.5)  # below 1 the frequencies grow along the head
    np.testing.assert_allclose(fast.inv_freq(), 0.5 ** -(np.arange(0, 8, 2) / 8), rtol=1e-6)
    with pytest.raises(ValueError, match=r"^RotaryEmbedding's theta must be positive, got -1\.0"):
        nn.RotaryEmbedding(8, theta=-1.0)


def test_rotation_runs_in_a_named_scope():
    x = jnp.asarray(randn(2, 5, 1, 8, seed=0))
    rotate = lambda x, at: nn.RotaryEmbedding(8)(x, at)
    jaxpr = jax.make_jaxpr(rotate)(x, jnp.arange(5)).jaxpr
    stacks = {str(eqn.source_info.name_stack) for eqn in jaxpr.eqns}
    assert stacks and all(stack.startswith("RotaryEmbedding") for stack in stacks), stacks


def test_low_precision_inputs_are_rotated_in_float32_and_rounded_once():
    rotary = nn.RotaryEmbedding(8)
    x = jnp.asarray(randn(2, 5, 2, 8, seed=0), jnp.bfloat16)
    at = jnp.arange(5) * 37
    expected = rotary(x.astype(jnp.float32), at).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(rotary(x, at), np.float32), expected)


def test_with_x64_float64_inputs_rotate_in_float64_and_float32_ones_in_float32():
    x32 = randn(2, 5, 2, 8, seed=0)
    at = np.arange(5, dtype=np.int32)
    expected = nn.RotaryEmbedding(8)(jnp.asarray(x32), jnp.asarray(at))
    with jax.enable_x64(True):
        rotary = nn.RotaryEmbedding(8)
        y = rotary(jnp.asarray(x32), jnp.asarray(at))
        assert y.dtype == jnp.float32
        np.testing.assert_array_equal(y, expected)  # the same float32 arithmetic
        # at position 0 nothing turns: a float64 input comes back exactly, not rounded
        x64 = jnp.asarray(1 + np.random.default_rng(1).random((1, 3, 2, 8)) * 1e-9, jnp.float64)
        y64 = rotary(x64, jnp.zeros(3, jnp.int32))
        assert y64.dtype == jnp.float64
        np.testing.assert_array_equal(y64, x64)


def _qwen(version: int):
    """A small random Qwen2 or Qwen3 attention (eager), its config and its state in
    MultiHeadAttention's names: Qwen2's query, key and value projections have biases and
    its output projection none; Qwen3's have none, and it RMS-normalises each query and key
    head (``q_norm``, ``k_norm``) before the rotation."""
    from transformers import Qwen2Config, Qwen3Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    kind, attention = (
        (Qwen2Config, Qwen2Attention) if version == 2 else (Qwen3Config, Qwen3Attention)
    )
    config = kind(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )  # fmt: skip
    config._attn_implementation = "eager"
    reference = randomize_(attention(config, layer_idx=0))
    names = {"q_proj": "query", "k_proj": "key", "v_proj": "value", "o_proj": "out"}
    names |= {"q_norm": "query_norm", "k_norm": "key_norm"}
    leaf = {"weight": "kernel", "bias": "bias"}
    state = {}
    for name, p in reference.named_parameters():
        module, kind_ = name.split(".")
        norm = module.endswith("_norm")
        key = f"{names[module]}.{'scale' if norm else leaf[kind_]}"
        state[key] = numpy(p) if norm or kind_ == "bias" else numpy(p.T)
    return config, reference, state


@pytest.mark.parametrize("version", [2, 3])
def test_qwen_attention_biases_and_head_norms_match_hugging_face(version):
    """Qwen2 (biases but on the output projection: ``use_out_bias=False``) and Qwen3 (each
    head RMS-normalised before the rotation: ``qk_norm_epsilon``) against transformers,
    causally, at positions of a later chunk (a norm after the rotation, or a bias on the
    output, would not match)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config, reference, state = _qwen(version)
    qwen2 = version == 2
    mha = build(
        lambda: nn.MultiHeadAttention(
            4, 32, qkv_features=32, num_kv_heads=2, rope_theta=1e4, use_bias=qwen2,
            use_out_bias=False, qk_norm_epsilon=None if qwen2 else 1e-5,
            precision="highest", rngs=nn.Rngs(0),
        ),
        state,
    )  # fmt: skip
    assert (mha.out.bias is None) and (mha.query.bias is not None) == qwen2
    assert (mha.query_norm is None) == qwen2 and (mha.key_norm is None) == qwen2
    x = randn(2, 6, 32, seed=4)
    positions = np.arange(6)[None] + 5
    embeddings = LlamaRotaryEmbedding(config)(torch.from_numpy(x), torch.from_numpy(positions))
    allowed = np.tril(np.ones((6, 6), bool))
    additive = np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)
    expected, _ = reference(
        torch.from_numpy(x),
        position_embeddings=embeddings,
        attention_mask=torch.from_numpy(additive[None, None]),
    )
    ours = mha(jnp.asarray(x), causal=True, positions=jnp.asarray(positions, jnp.int32))
    assert_close(ours, numpy(expected))


def test_the_head_norms_and_the_output_bias_are_parameters_only_when_asked():
    plain = nn.MultiHeadAttention(4, 32, rngs=nn.Rngs(0))
    normed = nn.MultiHeadAttention(
        4, 32, qkv_features=16, use_out_bias=False, qk_norm_epsilon=1e-6, rngs=nn.Rngs(0)
    )
    assert "query_norm.scale" not in plain.flat_state_dict() and plain.out.bias is not None
    shapes = {n: v.shape for n, v in normed.flat_state_dict().items()}
    assert shapes["query_norm.scale"] == shapes["key_norm.scale"] == (4,)  # head_dim 16 / 4
    assert "out.bias" not in shapes and shapes["query.bias"] == (16,)
    assert normed.query_norm is not None and normed.query_norm.epsilon == 1e-6
