"""Prints the importers' parity with the original implementations (the README's table): the max
relative error of our image and text embeddings against the golden outputs that open_clip,
timm and big_vision computed for the tiny fixtures in tests/data/pretrained/.

    JAX_PLATFORMS=cpu python benchmarks/pretrained_parity.py
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import test_pretrained_import as t  # noqa: E402  (the fixtures and the tiny timm trunk's config)
from prolip_jax.core.pretrained.loader import load_pretrained  # noqa: E402

SOURCES = (("open_clip 3.3.0, OpenAI-style CLIP", "openai_clip_tiny", {}),
           ("open_clip 3.3.0 + timm 1.0.31 SigLIP", "siglip_openclip_tiny", None),
           ("big_vision SigLIP two-tower", "siglip_bigvision_tiny.npz", {}))


def main() -> None:
    print("| source | image | text |\n|---|---|---|")
    for label, name, kw in SOURCES:
        kw = dict(format="timm_siglip", arch=t.timm_tiny_arch()) if kw is None else kw
        golden = t.golden(name.removesuffix(".npz"))
        config, params, _ = load_pretrained(t.DATA / name, **kw)
        image, text = t.embed(config, params, golden)
        print(f"| {label} | {t.rel_err(image, golden['image_embed']):.1e} | {t.rel_err(text, golden['text_embed']):.1e} |")


if __name__ == "__main__":
    main()
