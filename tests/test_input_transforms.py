"""Image transforms: shapes, ranges, the reference's augmentation statistics, normalisation."""
import colorsys
import math

import numpy as np
import pytest
from PIL import Image

from input_pipeline import transforms as T
from prolip_jax.core import normalization as N


def _noise_image(w, h, seed=0):
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(2, h // 8), max(2, w // 8), 3), np.uint8)
    return Image.fromarray(coarse).resize((w, h), Image.Resampling.BICUBIC)


@pytest.mark.parametrize("w,h", [(400, 300), (300, 300)])
def test_random_resized_crop_box_follows_torchvision_bounds(w, h):
    rng = np.random.default_rng(0)
    fracs, ratios = [], []
    for _ in range(2000):
        left, top, cw, ch = T.random_resized_crop_box(rng, w, h)
        assert 0 <= left and left + cw <= w and 0 <= top and top + ch <= h
        fracs.append(cw * ch / (w * h))
        ratios.append(cw / ch)
    fracs, ratios = np.array(fracs), np.array(ratios)
    # Area scale in [0.8, 1] and log-uniform aspect in [3/4, 4/3], up to integer rounding.
    assert fracs.min() >= 0.8 - 0.01 and fracs.max() <= 1.0
    assert ratios.min() >= 0.75 - 0.01 and ratios.max() <= 4 / 3 + 0.01
    assert 0.83 < fracs.mean() < 0.9        # uniform scale, minus boxes that did not fit
    if w == h:   # a box fits iff scale * max(r, 1/r) <= 1: r spans [0.8, 1.25] symmetrically
        assert ratios.min() < 0.83 and ratios.max() > 1.2
        assert abs(np.log(ratios).mean()) < 0.02
    else:        # landscape 4:3: only wide boxes keep 80% of the area
        assert ratios.min() > 1.0 and ratios.max() > 1.3


def test_random_resized_crop_box_fallback_for_extreme_aspect():
    # A 1000x10 strip never fits a crop of ratio <= 4/3 and area >= 80%: torchvision falls
    # back to a centred crop at the clamped ratio (full height, width = 4/3 * height).
    left, top, w, h = T.random_resized_crop_box(np.random.default_rng(0), 1000, 10)
    assert (w, h) == (13, 10) and top == 0 and left == (1000 - 13) // 2


def test_train_transform_shape_determinism_and_variety():
    img = _noise_image(400, 300)
    a = T.train_transform(img, 64, np.random.default_rng(7))
    b = T.train_transform(img, 64, np.random.default_rng(7))
    c = T.train_transform(img, 64, np.random.default_rng(8))
    assert a.shape == (64, 64, 3) and a.dtype == np.uint8
    np.testing.assert_array_equal(a, b)
    assert np.abs(a.astype(int) - c).mean() > 2


def test_color_matrix_probabilities():
    rng = np.random.default_rng(0)
    aug = T.AugmentConfig()
    n, none, grey = 4000, 0, 0
    for _ in range(n):
        m = T.color_matrix(rng, np.array([100.0, 120.0, 140.0]), aug)
        if m is None:
            none += 1
        elif np.allclose(m[0], m[1]) and np.allclose(m[1], m[2]):
            grey += 1   # a grayscale output has three identical rows
    # P(no op) = 0.2 * 0.8 = 0.16; P(grayscale) = 0.2.
    assert abs(none / n - 0.16) < 0.02
    assert abs(grey / n - 0.2) < 0.02


def test_brightness_only_jitter_factor_range():
    aug = T.AugmentConfig(color_jitter=(0.32, 0, 0, 0), color_jitter_prob=1.0,
                          grayscale_prob=0.0)
    img = Image.new("RGB", (32, 32), (100, 100, 100))
    rng = np.random.default_rng(0)
    means = [T.train_transform(img, 32, rng, aug).mean() / 100 for _ in range(300)]
    assert 0.68 - 0.01 <= min(means) < 0.75 and 1.25 < max(means) <= 1.32 + 0.01
    assert abs(np.mean(means) - 1.0) < 0.04


def test_grayscale_only_gives_equal_channels():
    aug = T.AugmentConfig(color_jitter_prob=0.0, grayscale_prob=1.0)
    out = T.train_transform(_noise_image(80, 60), 32, np.random.default_rng(0), aug)
    np.testing.assert_array_equal(out[..., 0], out[..., 1])
    np.testing.assert_array_equal(out[..., 1], out[..., 2])


def test_no_color_ops_is_a_plain_bicubic_crop():
    aug = T.AugmentConfig(color_jitter_prob=0.0, grayscale_prob=0.0)
    img = _noise_image(80, 60)
    out = T.train_transform(img, 32, np.random.default_rng(3), aug)
    left, top, w, h = T.random_resized_crop_box(np.random.default_rng(3), 80, 60)
    ref = img.resize((32, 32), Image.Resampling.BICUBIC, box=(left, top, left + w, top + h))
    np.testing.assert_array_equal(out, np.asarray(ref))


@pytest.mark.parametrize("hue", [0.0, 0.08])
def test_fast_color_jitter_close_to_torchvision_path(hue):
    fast = T.AugmentConfig(color_jitter=(0.32, 0.32, 0.32, hue), color_jitter_prob=1.0,
                           grayscale_prob=0.0)
    tv = T.AugmentConfig(color_jitter=(0.32, 0.32, 0.32, hue), color_jitter_prob=1.0,
                         grayscale_prob=0.0, color_jitter_impl="torchvision")
    img = _noise_image(120, 90)
    diffs = [np.abs(T.train_transform(img, 48, np.random.default_rng(s), fast).astype(float)
                    - T.train_transform(img, 48, np.random.default_rng(s), tv)).mean()
             for s in range(10)]
    # Brightness/contrast/saturation are the same linear ops (rounding and clipping aside);
    # the YIQ hue rotation differs from the HSV shift by a few levels on average.
    assert np.mean(diffs) < (3.0 if hue == 0 else 12.0)


def test_fast_hue_shift_moves_hue_like_torchvision():
    def hue_of(rgb):
        h = colorsys.rgb_to_hsv(*(np.asarray(rgb) / 255.0))[0]
        return h if h < 0.5 else h - 1
    red = np.array([220.0, 40.0, 40.0])
    for shift in (0.06, -0.06):
        moved = np.clip(T._hue_matrix(shift) @ red, 0, 255)
        assert math.copysign(1, hue_of(moved)) == math.copysign(1, shift)
        assert abs(hue_of(moved) - shift) < 0.03


def test_eval_transform_resizes_short_side_and_centre_crops():
    assert T.eval_resize_hw(400, 300, 224) == (298, 224)   # torchvision Resize(224)
    assert T.eval_resize_hw(300, 400, 224) == (224, 298)
    # No resize needed: the output is exactly the centre crop.
    arr = np.asarray(_noise_image(300, 224))
    out = T.eval_transform(Image.fromarray(arr), 224)
    np.testing.assert_array_equal(out, arr[:, 38:262])
    # Resized: the centre pixel of a radial pattern stays at the centre.
    yy, xx = np.mgrid[0:300, 0:400]
    dist = np.sqrt((yy - 149.5) ** 2 + (xx - 199.5) ** 2)
    ramp = np.clip(dist, 0, 255).astype(np.uint8)
    out = T.eval_transform(Image.fromarray(np.dstack([ramp] * 3)), 64)
    assert out.shape == (64, 64, 3)
    assert np.unravel_index(np.argmin(out[..., 0]), (64, 64)) in [(31, 31), (31, 32),
                                                                 (32, 31), (32, 32)]


def test_normalize_values_and_device_version_agree():
    x = np.array([[[0, 128, 255]]], np.uint8)
    out = N.normalize(x, "openai")
    expected = (np.array([0, 128, 255]) / 255.0 - np.array(N.OPENAI_MEAN)) / np.array(
        N.OPENAI_STD)
    np.testing.assert_allclose(out[0, 0], expected, rtol=1e-5)
    half = N.normalize(np.array([0, 255], np.uint8)[:, None].repeat(3, 1), "0.5")
    np.testing.assert_allclose(half, [[-1, -1, -1], [1, 1, 1]], atol=1e-6)
    batch = np.random.default_rng(0).integers(0, 256, (2, 4, 4, 3), np.uint8)
    np.testing.assert_allclose(np.asarray(N.normalize_on_device(batch, "openai")),
                               N.normalize(batch, "openai"), atol=1e-5)
    with pytest.raises(ValueError, match="Unknown normalization"):
        N.normalize(batch, "imagenet")


def test_normalized_statistics_of_natural_images():
    # Eval-transformed natural-ish images, normalised with CLIP stats: roughly centred.
    imgs = np.stack([T.eval_transform(_noise_image(64, 48, s), 32) for s in range(20)])
    out = N.normalize(imgs, "openai")
    assert out.dtype == np.float32 and out.shape == (20, 32, 32, 3)
    assert np.isfinite(out).all()
    assert -1.8 <= out.min() and out.max() <= 2.2   # (0 - .48)/.27 .. (1 - .41)/.28
    assert abs(out.mean()) < 0.5


def test_record_rng_is_default_rng_of_the_key():
    """decode.record_rng builds the per-record Generator from uint32 words: the stream must be
    np.random.default_rng((seed, *rng_key))'s, also for keys past 32 bits (the tuple path)."""
    from input_pipeline.decode import record_rng

    for seed, key in [(0, (0, 0)), (0, (3, 123_456)), (2**32 - 1, (7, 2**31)), (5, (1, 2, 3)),
                      (0, (2**32, 1)), (2**40 + 3, (0, 9)), (np.int64(4), (np.int64(2), np.uint32(8)))]:
        want = np.random.default_rng((seed, *key)).random(8)
        np.testing.assert_array_equal(record_rng(seed, key).random(8), want)
    assert not np.array_equal(record_rng(0, (0, 1)).random(4), record_rng(0, (1, 0)).random(4))
