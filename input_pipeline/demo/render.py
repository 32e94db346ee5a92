"""Procedural images with hierarchical captions: the demo dataset's content.

An image is one coloured shape on a grey background. Four factors are captioned (shape, colour,
size, position); the background (style and grey levels) and small jitters of hue, saturation,
size, position and rotation are not, so each caption matches many different images.

Caption levels, from general to specific (ProLIP's inclusion structure, paper §3.3):
    0  "a shape"
    1  "a circle"
    2  "a red circle"
    3  "a small red circle in the top left"

Everything is a pure function of a numpy Generator, so an image is determined by its seed.
"""
from __future__ import annotations

import colorsys
import dataclasses
import math

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle", "diamond", "star", "cross")
# Hues 60 degrees apart, so neither the per-image hue jitter here nor a hue augmentation of up
# to +-29 degrees (ColorJitter hue=0.08) can turn one colour into its neighbour.
COLOURS = {"red": 0.0, "yellow": 60.0, "green": 120.0, "cyan": 180.0, "blue": 240.0,
           "magenta": 300.0}
COLOUR_NAMES = tuple(COLOURS)
SIZES = {"small": 0.14, "medium": 0.2, "large": 0.26}   # radius / image side
SIZE_NAMES = tuple(SIZES)
# (row, col) on a 3x3 grid -> phrase; centres at 28%, 50%, 72% of the side.
POSITIONS = (("in the top left", "at the top", "in the top right"),
             ("on the left", "in the centre", "on the right"),
             ("in the bottom left", "at the bottom", "in the bottom right"))
POSITION_NAMES = tuple(p for row in POSITIONS for p in row)
_GRID = (0.28, 0.5, 0.72)
BACKGROUNDS = ("plain", "vertical", "horizontal", "diagonal")
LEVEL_NAMES = ("shape", "shape+class", "colour+shape", "size+colour+shape+position")
_SUPERSAMPLE = 4


@dataclasses.dataclass(frozen=True)
class Factors:
    """The captioned factors of one image, as indices into the name tuples above."""
    shape: int
    colour: int
    size: int
    position: int   # row * 3 + col

    def captions(self) -> tuple[str, str, str, str]:
        """The four caption levels, general to specific."""
        shape, colour = SHAPES[self.shape], COLOUR_NAMES[self.colour]
        return ("a shape", f"a {shape}", f"a {colour} {shape}",
                f"a {SIZE_NAMES[self.size]} {colour} {shape} {POSITION_NAMES[self.position]}")

    def meta(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def random_factors(rng: np.random.Generator) -> Factors:
    return Factors(int(rng.integers(len(SHAPES))), int(rng.integers(len(COLOURS))),
                   int(rng.integers(len(SIZES))), int(rng.integers(len(POSITION_NAMES))))


def _polygon(shape: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    """Vertices of a shape of 'radius' r around (cx, cy), rotated by `angle` radians."""
    if shape == "square":
        pts = [(-0.8, -0.8), (0.8, -0.8), (0.8, 0.8), (-0.8, 0.8)]
    elif shape == "triangle":
        pts = [(math.cos(a), math.sin(a)) for a in
               (-math.pi / 2, -math.pi / 2 + 2 * math.pi / 3, -math.pi / 2 + 4 * math.pi / 3)]
    elif shape == "diamond":   # a rhombus, taller than wide: never a rotated square
        pts = [(0.0, -1.0), (0.65, 0.0), (0.0, 1.0), (-0.65, 0.0)]
    elif shape == "star":
        pts = [((1.0 if k % 2 == 0 else 0.45) * math.cos(-math.pi / 2 + k * math.pi / 5),
                (1.0 if k % 2 == 0 else 0.45) * math.sin(-math.pi / 2 + k * math.pi / 5))
               for k in range(10)]
    elif shape == "cross":
        w = 0.3
        pts = [(-w, -1), (w, -1), (w, -w), (1, -w), (1, w), (w, w), (w, 1), (-w, 1), (-w, w),
               (-1, w), (-1, -w), (-w, -w)]
    else:
        raise ValueError(f"unknown shape {shape!r}")
    c, s = math.cos(angle), math.sin(angle)
    return [(cx + r * (x * c - y * s), cy + r * (x * s + y * c)) for x, y in pts]


def _background(rng: np.random.Generator, n: int) -> np.ndarray:
    """float32 [n, n, 1] grey levels: plain or a linear gradient."""
    style = BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))]
    a, b = rng.uniform(25, 230, size=2)
    t = np.linspace(0.0, 1.0, n, dtype=np.float32)
    if style == "plain":
        grey = np.full((n, n), a, np.float32)
    elif style == "vertical":
        grey = np.repeat((a + (b - a) * t)[:, None], n, axis=1)
    elif style == "horizontal":
        grey = np.repeat((a + (b - a) * t)[None, :], n, axis=0)
    else:
        grey = a + (b - a) * (t[:, None] + t[None, :]) / 2
    return grey[..., None]


def render(factors: Factors, rng: np.random.Generator, size: int) -> np.ndarray:
    """uint8 [size, size, 3]. The shape's coverage mask is drawn at 4x and box-filtered down
    (anti-aliased edges), then the colour is blended onto the background with it."""
    background = _background(rng, size)
    hue = (COLOURS[COLOUR_NAMES[factors.colour]] + rng.uniform(-8, 8)) / 360.0
    fill = np.asarray(colorsys.hsv_to_rgb(hue % 1.0, rng.uniform(0.75, 1.0),
                                          rng.uniform(0.8, 1.0)), np.float32) * 255
    n = size * _SUPERSAMPLE
    row, col = divmod(factors.position, 3)
    cx = (_GRID[col] + rng.uniform(-0.03, 0.03)) * n
    cy = (_GRID[row] + rng.uniform(-0.03, 0.03)) * n
    r = SIZES[SIZE_NAMES[factors.size]] * rng.uniform(0.92, 1.08) * n
    mask = Image.new("L", (n, n), 0)
    draw = ImageDraw.Draw(mask)
    shape = SHAPES[factors.shape]
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=255)
    else:
        angle = math.radians(rng.uniform(-10, 10))
        draw.polygon(_polygon(shape, cx, cy, r, angle), fill=255)
    alpha = np.asarray(mask.resize((size, size), Image.Resampling.BOX), np.float32)[..., None]
    alpha *= 1.0 / 255
    out = background + alpha * (fill - background)
    return np.clip(out + 0.5, 0, 255).astype(np.uint8)
