"""Embed against torch.nn.Embedding: lookups, the tied output projection, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _torch import assert_close, numpy, randomize_

from taktiny import nn


def convert(torch_embedding):
    return {"embedding": numpy(torch_embedding.weight)}


@pytest.mark.parametrize("ids_shape", [(), (7,), (3, 5), (2, 2, 4)])
def test_lookup_matches_torch(ids_shape):
    reference = randomize_(torch.nn.Embedding(11, 6))
    ids = torch.randint(0, 11, ids_shape, generator=torch.Generator().manual_seed(1))
    embed = nn.Embed(11, 6, rngs=nn.Rngs(0)).load_flat_state_dict(convert(reference), strict=True)
    y = embed(jnp.asarray(numpy(ids)))
    assert y.shape == (*ids_shape, 6) and y.dtype == jnp.float32
    assert_close(y, numpy(reference(ids)))


@pytest.mark.parametrize("batch", [(), (4,), (2, 3)])
def test_attend_matches_a_tied_torch_projection(batch):
    reference = randomize_(torch.nn.Embedding(11, 6))
    x = torch.randn(*batch, 6, generator=torch.Generator().manual_seed(2))
    embed = nn.Embed(11, 6, precision="highest", rngs=nn.Rngs(0))
    embed = embed.load_flat_state_dict(convert(reference))
    expected = torch.nn.functional.linear(x, reference.weight)  # x @ weight.T
    assert_close(embed.attend(jnp.asarray(numpy(x))), numpy(expected))


def test_init_is_standard_normal_and_the_state_is_the_table():
    embed = nn.Embed(1000, 64, rngs=nn.Rngs(0))
    assert list(embed.flat_state_dict()) == ["embedding"]
    assert embed.embedding.shape == (1000, 64)
    assert abs(float(embed.embedding.mean())) < 0.01
    assert abs(float(embed.embedding.std()) - 1.0) < 0.01
    assert not np.array_equal(embed.embedding, nn.Embed(1000, 64, rngs=nn.Rngs(1)).embedding)


def test_param_dtype_is_the_tables_and_dtype_the_outputs():
    embed = nn.Embed(5, 4, param_dtype=jnp.bfloat16, rngs=nn.Rngs(0))
    assert embed.embedding.dtype == jnp.bfloat16
    assert embed(jnp.arange(3)).dtype == jnp.bfloat16
    assert embed.attend(jnp.ones((2, 4), jnp.float32)).dtype == jnp.bfloat16
    assert nn.Embed(5, 4, rngs=nn.Rngs(0))(jnp.arange(3, dtype=jnp.uint8)).shape == (3, 4)
    # a float32 table looked up in bfloat16: the rows rounded, the table kept
    embed = nn.Embed(5, 4, dtype=jnp.bfloat16, rngs=nn.Rngs(0))
    rows = embed(jnp.array([4, -1, 5]))
    assert rows.dtype == jnp.bfloat16 and embed.embedding.dtype == jnp.float32
    np.testing.assert_array_equal(rows[0], embed.embedding[4].astype(jnp.bfloat16))
    assert np.isnan(np.asarray(rows[2], np.float32)).all()  # past the end: NaNs still
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4)), jnp.float32)
    scores = embed.attend(x)
    assert scores.dtype == jnp.bfloat16
    table = np.asarray(embed.embedding.astype(jnp.bfloat16), np.float64)
    expected = np.asarray(x.astype(jnp.bfloat16), np.float64) @ table.T
    np.testing.assert_allclose(np.asarray(scores, np.float64), expected, rtol=2**-7, atol=1e-2)


def test_ids_out_of_range_give_nan_rows_and_negative_ids_count_from_the_end():
    embed = nn.Embed(5, 3, rngs=nn.Rngs(0))
    y = jax.jit(embed.__call__)(jnp.array([0, 5, -1]))
    np.testing.assert_array_equal(y[0], embed.embedding[0])
    assert np.isnan(y[1]).all()
    np.testing.assert_array_equal(y[2], embed.embedding[4])


def test_attend_rejects_the_wrong_feature_size():
    embed = nn.Embed(10, 8, rngs=nn.Rngs(0))
    with pytest.raises(
        ValueError,
        match=r"Embed\.attend expects inputs whose last axis has 8 features \(its embedding is "
        r"\(10, 8\)\), got an input of shape \(2, 5\).*features=5",
    ):
        embed.attend(jnp.ones((2, 5)))
