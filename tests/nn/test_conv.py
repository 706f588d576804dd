"""Conv and ConvTranspose against torch.nn.Conv{1,2,3}d and ConvTranspose{1,2,3}d."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _torch import assert_close, build, channels_last, numpy, randomize_

from taktiny import nn
from taktiny.nn._convolution import window_of


def convert_conv(reference):
    """OIHW -> HWIO (and the 1D/3D analogues: the first two axes go last, swapped)."""
    weight = reference.weight
    n = weight.ndim - 2
    state = {"kernel": numpy(weight.permute(*range(2, 2 + n), 1, 0))}
    if reference.bias is not None:
        state["bias"] = numpy(reference.bias)
    return state


def convert_conv_transpose(reference):
    """[in, out/groups, *window] -> [*window, in/groups, out], mirrored in space."""
    weight, groups = reference.weight, reference.groups
    n = weight.ndim - 2
    window = weight.shape[2:]
    in_per_group, out_per_group = weight.shape[0] // groups, weight.shape[1]
    weight = weight.reshape(groups, in_per_group, out_per_group, *window)
    weight = weight.permute(*range(3, 3 + n), 1, 0, 2).reshape(
        *window, in_per_group, groups * out_per_group
    )
    state = {"kernel": numpy(weight.flip(list(range(n))))}
    if reference.bias is not None:
        state["bias"] = numpy(reference.bias)
    return state


# (kernel_size, strides, padding, dilation, groups, spatial size)
CONV_CASES = [
    ((3,), 1, "SAME", 1, 1, (9,)),
    pytest.param(  # even kernel: the odd padding goes at the end, as in torch
        (4,),
        1,
        "SAME",
        1,
        1,
        (9,),
        # torch warns that it copies the input to pad it unevenly; that is expected here
        marks=pytest.mark.filterwarnings(
            "ignore:Using padding='same' with even kernel:UserWarning"
        ),
    ),
    ((5,), 2, 2, 1, 3, (11,)),
    ((3,), 3, "VALID", 2, 1, (10,)),
    ((3, 3), 1, "SAME", 1, 1, (6, 7)),
    ((3, 3), 2, 1, 1, 1, (7, 8)),
    ((2, 4), (2, 1), (0, 2), 1, 3, (6, 5)),
    ((3, 3), 1, "VALID", (2, 1), 6, (7, 7)),  # depthwise
    ((3, 3, 3), 1, "SAME", 1, 1, (4, 5, 4)),
    ((2, 3, 1), (1, 2, 1), (1, 0, 0), 1, 3, (4, 5, 3)),
]


def torch_padding(padding):
    return padding.lower() if isinstance(padding, str) else padding


@pytest.mark.parametrize("kernel_size, strides, padding, dilation, groups, size", CONV_CASES)
def test_conv_matches_torch(kernel_size, strides, padding, dilation, groups, size):
    n = len(kernel_size)
    in_features, out_features = 6, 9 if groups != 6 else 12
    reference = getattr(torch.nn, f"Conv{n}d")(
        in_features,
        out_features,
        kernel_size,
        stride=strides,
        padding=torch_padding(padding),
        dilation=dilation,
        groups=groups,
    )
    randomize_(reference)
    conv = build(
        lambda: nn.Conv(
            in_features,
            out_features,
            kernel_size,
            strides=strides,
            padding=padding,
            kernel_dilation=dilation,
            feature_group_count=groups,
            precision="highest",
            rngs=nn.Rngs(0),
        ),
        convert_conv(reference),
    )
    x = torch.randn(2, in_features, *size, generator=torch.Generator().manual_seed(0))
    assert_close(conv(jnp.asarray(channels_last(x))), channels_last(reference(x)))


def test_conv_without_bias_and_with_any_batch_axes():
    reference = randomize_(torch.nn.Conv2d(3, 4, (3, 3), padding=1, bias=False))
    conv = nn.Conv(3, 4, (3, 3), padding=1, use_bias=False, precision="highest", rngs=nn.Rngs(0))
    assert list(conv.flat_state_dict()) == ["kernel"]
    conv = conv.load_flat_state_dict(convert_conv(reference), strict=True)
    x = torch.randn(6, 3, 5, 5, generator=torch.Generator().manual_seed(0))
    expected = channels_last(reference(x))
    ours = jnp.asarray(channels_last(x))
    assert_close(conv(ours[0]), expected[0])  # no batch axis
    assert_close(conv(ours.reshape(2, 3, 5, 5, 3)), expected.reshape(2, 3, 5, 5, 4))


@pytest.mark.parametrize("input_dilation, strides, padding", [(2, 1, "SAME"), ((2, 3), 2, 1)])
def test_input_dilation_is_a_conv_of_the_zero_dilated_input(input_dilation, strides, padding):
    """PyTorch has no input dilation: the oracle spreads the input out with zeros itself."""
    reference = randomize_(torch.nn.Conv2d(3, 4, (3, 3), stride=strides, padding=0))
    conv = build(
        lambda: nn.Conv(
            3,
            4,
            (3, 3),
            strides=strides,
            padding=padding,
            input_dilation=input_dilation,
            precision="highest",
            rngs=nn.Rngs(0),
        ),
        convert_conv(reference),
    )
    x = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(0))
    dh, dw = (input_dilation,) * 2 if isinstance(input_dilation, int) else input_dilation
    dilated = torch.zeros(2, 3, (4 - 1) * dh + 1, (5 - 1) * dw + 1)
    dilated[:, :, ::dh, ::dw] = x
    if padding == "SAME":  # stride 1, kernel 3: one zero on each side
        dilated = torch.nn.functional.pad(dilated, (1, 1, 1, 1))
    else:
        dilated = torch.nn.functional.pad(dilated, (padding,) * 4)
    assert_close(conv(jnp.asarray(channels_last(x))), channels_last(reference(dilated)))


# (kernel_size, strides, torch padding, output_padding, dilation, groups, spatial size)
TRANSPOSE_CASES = [
    ((3,), 1, 0, 0, 1, 1, (7,)),
    ((4,), 2, 1, 0, 1, 3, (6,)),
    ((3,), 3, 1, 2, 2, 1, (5,)),
    ((3, 3), 2, 1, 1, 1, 1, (4, 5)),
    ((4, 4), 2, 1, 0, 1, 3, (5, 4)),
    ((2, 3), (1, 2), (0, 1), (0, 1), (1, 2), 1, (4, 4)),
    ((2, 3, 2), (2, 1, 2), (0, 1, 0), (1, 0, 1), 1, 3, (3, 4, 3)),
]


@pytest.mark.parametrize(
    "kernel_size, strides, padding, output_padding, dilation, groups, size", TRANSPOSE_CASES
)
def test_conv_transpose_matches_torch(
    kernel_size, strides, padding, output_padding, dilation, groups, size
):
    n = len(kernel_size)
    reference = getattr(torch.nn, f"ConvTranspose{n}d")(
        6,
        9,
        kernel_size,
        stride=strides,
        padding=padding,
        output_padding=output_padding,
        dilation=dilation,
        groups=groups,
    )
    randomize_(reference)
    pads = (padding,) * n if isinstance(padding, int) else padding
    extra = (output_padding,) * n if isinstance(output_padding, int) else output_padding
    conv = build(
        lambda: nn.ConvTranspose(
            6,
            9,
            kernel_size,
            strides=strides,
            padding=[(p, p - e) for p, e in zip(pads, extra, strict=True)],
            kernel_dilation=dilation,
            feature_group_count=groups,
            precision="highest",
            rngs=nn.Rngs(0),
        ),
        convert_conv_transpose(reference),
    )
    x = torch.randn(2, 6, *size, generator=torch.Generator().manual_seed(0))
    assert_close(conv(jnp.asarray(channels_last(x))), channels_last(reference(x)))


@pytest.mark.parametrize(
    "kernel_size, strides, torch_padding, output_padding",
    [((4, 4), 2, 1, 0), ((3, 3), 2, 1, 1), ((3,), 1, 1, 0), ((2,), 3, 0, 1)],
)
def test_conv_transpose_same_and_int_padding_agree_with_torch(
    kernel_size, strides, torch_padding, output_padding
):
    """SAME gives size * stride, cropped as torch's usual upsampling settings crop."""
    n = len(kernel_size)
    reference = getattr(torch.nn, f"ConvTranspose{n}d")(
        4, 5, kernel_size, stride=strides, padding=torch_padding, output_padding=output_padding
    )
    randomize_(reference)
    x = torch.randn(2, 4, *(5,) * n, generator=torch.Generator().manual_seed(0))
    expected = channels_last(reference(x))
    assert expected.shape[1:-1] == (5 * strides,) * n
    state = convert_conv_transpose(reference)
    same = build(
        lambda: nn.ConvTranspose(
            4,
            5,
            kernel_size,
            strides=strides,
            padding="SAME",
            precision="highest",
            rngs=nn.Rngs(0),
        ),
        state,
    )
    assert_close(same(jnp.asarray(channels_last(x))), expected)
    if output_padding == 0:
        as_int = build(
            lambda: nn.ConvTranspose(
                4,
                5,
                kernel_size,
                strides=strides,
                padding=torch_padding,
                precision="highest",
                rngs=nn.Rngs(0),
            ),
            state,
        )
        assert_close(as_int(jnp.asarray(channels_last(x))), expected)


def test_conv_transpose_valid_gives_the_full_output():
    layer = nn.ConvTranspose(
        2, 3, (3,), strides=2, padding="VALID", kernel_dilation=2, rngs=nn.Rngs(0)
    )
    assert layer(jnp.ones((1, 4, 2))).shape == (1, (4 - 1) * 2 + 2 * 2 + 1, 3)


def test_init_is_lecun_normal_over_the_window_and_grouped_inputs():
    conv = nn.Conv(32, 64, (3, 3), feature_group_count=2, rngs=nn.Rngs(0))
    assert conv.kernel.shape == (3, 3, 16, 64) and conv.bias is not None
    np.testing.assert_array_equal(conv.bias, np.zeros(64))
    fan_in = 3 * 3 * 16
    assert abs(float(conv.kernel.std()) * np.sqrt(fan_in) - 1) < 0.05
    transpose = nn.ConvTranspose(32, 64, (4,), rngs=nn.Rngs(0))
    assert transpose.kernel.shape == (4, 32, 64)
    assert abs(float(transpose.kernel.std()) * np.sqrt(4 * 32) - 1) < 0.05


def test_convs_work_under_jit_and_grad_and_keep_their_dtype():
    conv = nn.Conv(3, 4, (3, 3), param_dtype=jnp.bfloat16, rngs=nn.Rngs(0))
    x = jnp.ones((2, 5, 5, 3), jnp.float32)
    assert jax.jit(conv.__call__)(x).dtype == jnp.bfloat16
    grads = jax.grad(lambda c: jnp.sum(c(x).astype(jnp.float32)))(conv)
    assert grads.kernel.shape == (3, 3, 3, 4) and grads.kernel.dtype == jnp.bfloat16
    transpose = nn.ConvTranspose(3, 4, (3, 3), strides=2, rngs=nn.Rngs(0))
    assert jax.jit(transpose.__call__)(x).shape == (2, 10, 10, 4)


@pytest.mark.parametrize("layer_type", [nn.Conv, nn.ConvTranspose])
def test_convs_reject_the_wrong_feature_size(layer_type):
    layer = layer_type(4, 8, (3, 3), rngs=nn.Rngs(0))
    name = layer_type.__name__
    with pytest.raises(
        ValueError,
        match=rf"{name} expects inputs whose last axis has 4 features \(its kernel is "
        r"\(3, 3, 4, 8\)\), got an input of shape \(2, 5, 5, 3\).*in_features=3",
    ):
        layer(jnp.ones((2, 5, 5, 3)))
    grouped = layer_type(4, 8, (3,), feature_group_count=2, rngs=nn.Rngs(0))
    with pytest.raises(ValueError, match=r"4 features \(its kernel is \(3, 2, 8\) with 2 groups\)"):
        grouped(jnp.ones((2, 5, 2)))


@pytest.mark.parametrize("layer_type", [nn.Conv, nn.ConvTranspose])
def test_convs_reject_inputs_without_spatial_axes(layer_type):
    layer = layer_type(4, 8, (3, 3), rngs=nn.Rngs(0))
    with pytest.raises(
        ValueError,
        match=rf"{layer_type.__name__} has a 2D kernel \(3, 3, 4, 8\), so it expects inputs "
        r"\[\*batch, 2 spatial axes, 4 features\] \(channels last\), got an input of shape "
        r"\(5, 4\)",
    ):
        layer(jnp.ones((5, 4)))


@pytest.mark.parametrize("layer_type", [nn.Conv, nn.ConvTranspose])
def test_convs_reject_bad_arguments(layer_type):
    name = layer_type.__name__
    with pytest.raises(TypeError, match="kernel_size"):  # beartype's check, in the tests
        layer_type(4, 8, "3", rngs=nn.Rngs(0))
    with pytest.raises(
        TypeError, match=rf"{name}'s kernel_size must be an int or a tuple of ints.*got '3'"
    ):
        window_of(name, "3", None)  # the layer's own check, which users without beartype see
    with pytest.raises(
        ValueError,
        match=rf"{name}'s kernel_size must have 1 to 22 entries, each at least 1; got \(3, 0\)",
    ):
        layer_type(4, 8, (3, 0), rngs=nn.Rngs(0))
    with pytest.raises(
        ValueError, match=rf"{name}'s feature_group_count \(3\) must divide both in_features \(4\)"
    ):
        layer_type(4, 6, (3,), feature_group_count=3, rngs=nn.Rngs(0))
    with pytest.raises(
        ValueError,
        match=rf"{name}'s strides must be a positive int or 2 positive ints.*got \(1, 2, 3\)",
    ):
        layer_type(4, 8, (3, 3), strides=(1, 2, 3), rngs=nn.Rngs(0))
    with pytest.raises(ValueError) as raised:
        layer_type(4, 8, (3, 3), kernel_dilation=(1, 0), rngs=nn.Rngs(0))
    assert str(raised.value) == (
        f"{name}'s kernel_dilation must be a positive int or 2 positive ints (one per spatial "
        "axis of its 2D kernel_size), got (1, 0)."
    )
    with pytest.raises(ValueError, match=rf"{name}'s padding must be 'SAME', 'VALID'.*got 'FULL'"):
        layer_type(4, 8, (3, 3), padding="FULL", rngs=nn.Rngs(0))
    with pytest.raises(
        ValueError, match=rf"{name}'s padding .* 2 ints or \(low, high\) pairs.*got \[1, 2, 3\]"
    ):
        layer_type(4, 8, (3, 3), padding=[1, 2, 3], rngs=nn.Rngs(0))


@pytest.mark.parametrize("layer_type", [nn.Conv, nn.ConvTranspose])
def test_convs_take_up_to_22_spatial_axes_and_whole_padding_pairs(layer_type, without_type_checks):
    """A kernel may have as many spatial axes as the dimension numbers have letters for
    (22); padding pairs must be two ints each, and Conv's input_dilation one positive int
    per axis. Each refusal names the layer, the argument and the value."""
    name = layer_type.__name__
    assert layer_type(1, 1, (1,) * 22, rngs=nn.Rngs(0)).kernel.shape == (1,) * 24
    with pytest.raises(ValueError) as raised:
        layer_type(1, 1, (1,) * 23, rngs=nn.Rngs(0))
    assert str(raised.value) == (
        f"{name}'s kernel_size must have 1 to 22 entries, each at least 1; got {(1,) * 23}."
    )
    for padding in [((1, 2, 3), 1), ((1, 2.5), 1), (1, (2,))]:
        with pytest.raises(ValueError) as raised:
            layer_type(4, 8, (3, 3), padding=padding, rngs=nn.Rngs(0))
        assert str(raised.value) == (
            f"{name}'s padding must be 'SAME', 'VALID', an int, or 2 ints or (low, high) pairs "
            f"(one per spatial axis of its 2D kernel_size); got {padding!r}."
        )
    if layer_type is nn.Conv:
        with pytest.raises(ValueError) as raised:
            nn.Conv(4, 8, (3, 3), input_dilation=(2, 0), rngs=nn.Rngs(0))
        assert str(raised.value) == (
            "Conv's input_dilation must be a positive int or 2 positive ints (one per spatial "
            "axis of its 2D kernel_size), got (2, 0)."
        )


def test_conv_transpose_rejects_padding_that_crops_everything():
    """Cropping may leave as little as one element (here the kernel's centre tap on a
    one-element input), but not less."""
    layer = nn.ConvTranspose(2, 2, (3,), padding=1, precision="highest", rngs=nn.Rngs(0))
    x = np.random.default_rng(0).normal(size=(1, 1, 2))
    expected = x @ np.asarray(layer.kernel[1], np.float64) + np.asarray(layer.bias)
    np.testing.assert_allclose(layer(jnp.asarray(x, jnp.float32)), expected, atol=1e-6)
    layer = nn.ConvTranspose(2, 2, (3,), padding=3, rngs=nn.Rngs(0))
    with pytest.raises(
        ValueError,
        match=r"ConvTranspose's padding \(\(3, 3\),\) crops more than the full output \(4,\) of "
        r"an input of shape \(1, 2, 2\) holds \(it would leave \(-2,\)\)",
    ):
        layer(jnp.ones((1, 2, 2)))


@pytest.mark.parametrize("layer_type", [nn.Conv, nn.ConvTranspose])
def test_convs_default_to_same_padding(layer_type):
    """The documented default padding is "SAME", in the signature and on the layer."""
    assert inspect.signature(layer_type.__init__).parameters["padding"].default == "SAME"
    assert layer_type(2, 3, (3,), rngs=nn.Rngs(0)).padding == "SAME"
    doc = " ".join(layer_type.__doc__.split())  # and documented as differing from PyTorch's
    assert '``"SAME"`` (the default; PyTorch\'s default is ``0``, which is ``"VALID"`` here)' in doc


# --- PyTorch-style arguments: an int kernel_size, int and tuple padding ---------------------


@pytest.mark.parametrize(
    "torch_kwargs, ours",
    [
        ({"kernel_size": 3, "padding": 1}, {"kernel_size": 3, "dims": 2, "padding": 1}),
        ({"kernel_size": 3}, {"kernel_size": 3, "dims": 2, "padding": 0}),  # torch's default
        ({"kernel_size": 3, "stride": 2, "padding": 2, "dilation": 2},
         {"kernel_size": 3, "dims": 2, "strides": 2, "padding": 2, "kernel_dilation": 2}),
        ({"kernel_size": 3, "padding": (1, 2)}, {"kernel_size": 3, "padding": (1, 2)}),
        ({"kernel_size": 3, "stride": (2, 1)}, {"kernel_size": 3, "strides": (2, 1), "padding": 0}),
        ({"kernel_size": (3, 1), "padding": 1}, {"kernel_size": (3, 1), "padding": 1}),
    ],
)  # fmt: skip
def test_pytorch_style_conv_arguments_match_torch(torch_kwargs, ours):
    """An int kernel_size with dims= (or with a tuple among the other arguments), and an int
    or a tuple of ints as padding: the zeros PyTorch's padding=p puts on both sides."""
    reference = randomize_(torch.nn.Conv2d(3, 5, **torch_kwargs))
    conv = build(lambda: nn.Conv(3, 5, **ours, precision="highest", rngs=nn.Rngs(0)),
                 convert_conv(reference))  # fmt: skip
    x = torch.randn(2, 3, 9, 8, generator=torch.Generator().manual_seed(0))
    assert conv.kernel.shape[:2] == reference.weight.shape[2:]
    assert_close(conv(jnp.asarray(channels_last(x))), channels_last(reference(x)))


def test_pytorch_style_conv_transpose_arguments_match_torch():
    reference = randomize_(torch.nn.ConvTranspose2d(3, 5, 4, stride=2, padding=1))
    ours = build(
        lambda: nn.ConvTranspose(3, 5, 4, dims=2, strides=2, padding=1, precision="highest",
                                 rngs=nn.Rngs(0)),
        convert_conv_transpose(reference),
    )  # fmt: skip
    x = torch.randn(2, 3, 5, 6, generator=torch.Generator().manual_seed(0))
    assert_close(ours(jnp.asarray(channels_last(x))), channels_last(reference(x)))
    reference = randomize_(torch.nn.ConvTranspose1d(3, 5, 3, stride=2, padding=1))
    ours = build(
        lambda: nn.ConvTranspose(3, 5, 3, strides=(2,), padding=1, precision="highest",
                                 rngs=nn.Rngs(0)),
        convert_conv_transpose(reference),
    )  # fmt: skip
    x = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0))
    assert_close(ours(jnp.asarray(channels_last(x))), channels_last(reference(x)))


@pytest.mark.parametrize("layer_type", [nn.Conv, nn.ConvTranspose])
@pytest.mark.parametrize(
    "arguments, window",
    [
        ({"dims": 1}, (3,)),
        ({"dims": 3}, (3, 3, 3)),
        ({"strides": (1, 2)}, (3, 3)),
        ({"padding": (1, 0, 1)}, (3, 3, 3)),
        ({"padding": [(1, 1), (0, 2)]}, (3, 3)),
        ({"kernel_dilation": (2,)}, (3,)),
        ({"dims": 2, "strides": (1, 2)}, (3, 3)),
    ],
)
def test_an_int_kernel_size_takes_its_axes_from_dims_or_a_tuple_argument(
    layer_type, arguments, window
):
    layer = layer_type(4, 8, 3, **arguments, rngs=nn.Rngs(0))
    assert layer.kernel.shape == (*window, 4, 8)
    assert len(layer.strides) == len(window)


def test_an_int_input_dilation_tuple_fixes_the_axes_of_conv():
    assert nn.Conv(4, 8, 3, input_dilation=(1, 2), rngs=nn.Rngs(0)).kernel.shape == (3, 3, 4, 8)


@pytest.mark.parametrize("layer_type", [nn.Conv, nn.ConvTranspose])
def test_an_int_kernel_size_without_its_axes_is_refused(layer_type, without_type_checks):
    name = layer_type.__name__
    for padding in ("SAME", 1):  # neither a string nor an int says how many axes
        with pytest.raises(ValueError) as raised:
            layer_type(4, 8, 3, padding=padding, rngs=nn.Rngs(0))
        assert str(raised.value) == (
            f"{name}'s kernel_size=3 does not say how many spatial axes the convolution has: "
            f"pass kernel_size=(3, 3) or dims=2 for a 2D one ((3,) or dims=1 for 1D, "
            f"(3, 3, 3) or dims=3 for 3D)."
        )
    with pytest.raises(ValueError) as raised:
        layer_type(4, 8, (3, 3), dims=3, rngs=nn.Rngs(0))
    assert str(raised.value) == (
        f"{name}'s kernel_size (3, 3) has 2 spatial axes but dims=3; make them agree (or "
        f"leave dims out)."
    )
    for dims in (0, 23, 2.0, True):
        with pytest.raises(ValueError) as raised:
            layer_type(4, 8, 3, dims=dims, rngs=nn.Rngs(0))
        assert str(raised.value) == (
            f"{name}'s dims is the number of spatial axes, an int from 1 to 22; got {dims!r}."
        )
    with pytest.raises(
        ValueError,
        match=rf"{name}'s strides must be a positive int or 2 positive ints.*got \(1, 2, 3\)",
    ):
        layer_type(4, 8, 3, dims=2, strides=(1, 2, 3), rngs=nn.Rngs(0))
    with pytest.raises(
        ValueError, match=rf"{name}'s kernel_size must have 1 to 22 entries.*got \(0, 0\)"
    ):
        layer_type(4, 8, 0, dims=2, rngs=nn.Rngs(0))
