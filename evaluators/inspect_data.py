"""Dataset inspection by uncertainty: the most / least uncertain images and captions as an HTML
page (paper Fig. 4 and C.1), and the 2-D PCA picture of a few probabilistic embeddings as
ellipses (paper Fig. 1 / A.2). `scripts/inspect_uncertainty.py` is the command line.

    enc = encode_set(model, params, data, tokenizer)          # mu / log sigma^2 of every item
    write_html(out_dir, data, enc, top=16)                    # index.html + images/ + ranking.json
    pca_ellipses(mu, logvar, labels, out_dir / "ellipses.png")

Uncertainty is sigma^2 = tr(Sigma) = sum_d exp(log sigma_d^2) (paper §4.3, common.uncertainty).
Fig. C.1 also reports the CSD of the pair (lower = closer), shown beside each item here.
"""
from __future__ import annotations

import html
import io
import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from evaluators.common import Encoder, uncertainty
from input_pipeline.eval_data import EvalSet


def rank_by_sigma2(sigma2: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """(the `top` most uncertain indices, highest first; the `top` least, lowest first).
    Ties keep the lower index first."""
    s = np.asarray(sigma2, np.float64)
    top = min(top, len(s))
    return np.argsort(-s, kind="stable")[:top], np.argsort(s, kind="stable")[:top]


def encode_set(model: Any, params: Any, data: EvalSet, tokenizer: Any, batch_size: int = 64,
               image_size: int | None = None, normalization: str = "openai"
               ) -> dict[str, np.ndarray]:
    """image_mu / image_logvar [N, D] and text_mu / text_logvar [M, D] of an eval set with
    captions (read and encoded sharded, as the evaluators)."""
    import jax

    enc = Encoder(model, batch_size, normalization)
    size = int(image_size or model.config.vision.image_size)
    img = enc.dataset(params, data.batches(enc.batch_size * jax.process_count(), size,
                                           normalization), len(data))
    t_mu, t_lv = enc.texts(params, tokenizer(data.captions))
    if img.get("logvar") is None or t_lv is None:
        raise ValueError("inspection by uncertainty needs a probabilistic model (log sigma^2)")
    return {"image_mu": img["mu"], "image_logvar": img["logvar"], "text_mu": t_mu,
            "text_logvar": t_lv}


def record_image(record: dict[str, Any]) -> Any:
    """A PIL image from a raw eval record (encoded bytes or an array)."""
    from PIL import Image

    x = record["image"]
    if isinstance(x, (bytes, bytearray, memoryview)):
        return Image.open(io.BytesIO(bytes(x))).convert("RGB")
    return Image.fromarray(np.asarray(x, np.uint8))


def pair_csd(enc: dict[str, np.ndarray], caption_record: np.ndarray) -> np.ndarray:
    """[M] CSD between each caption and its own image (eq. 1: ||mu_v - mu_t||^2 + tr(S_v + S_t))."""
    i = np.asarray(caption_record)
    d = enc["image_mu"][i].astype(np.float64) - enc["text_mu"]
    return (d ** 2).sum(-1) + uncertainty(enc["image_logvar"])[i] + uncertainty(enc["text_logvar"])


def write_html(out_dir: str | Path, data: EvalSet, enc: dict[str, np.ndarray], top: int = 16,
               thumb: int = 128) -> dict[str, list[int]]:
    """out_dir/index.html (+ images/*.png thumbnails, ranking.json): the `top` most and least
    uncertain images (with their first caption) and captions (with their image). Returns the
    rankings {"images_most", "images_least", "captions_most", "captions_least"}."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    img_s2, txt_s2 = uncertainty(enc["image_logvar"]), uncertainty(enc["text_logvar"])
    cap_img = np.asarray(data.caption_record)
    csd = pair_csd(enc, cap_img)
    first_caption = {int(r): c for c, r in reversed(list(enumerate(cap_img)))}
    im_most, im_least = rank_by_sigma2(img_s2, top)
    tx_most, tx_least = rank_by_sigma2(txt_s2, top)
    ranking = {"images_most": im_most.tolist(), "images_least": im_least.tolist(),
               "captions_most": tx_most.tolist(), "captions_least": tx_least.tolist()}

    def thumbnail(i: int) -> str:
        name = f"images/img_{i:06d}.png"
        if not (out / name).exists():
            im = record_image(data.records[i])
            im.thumbnail((thumb, thumb))
            im.save(out / name)
        return name

    def cell(img: int, cap: int | None, sigma_line: str) -> str:
        text = "" if cap is None else html.escape(data.captions[cap])
        extra = "" if cap is None else f"<br><small>CSD {csd[cap]:.4g}</small>"
        return (f'<figure><img src="{thumbnail(img)}" width="{thumb}"><figcaption>{sigma_line}'
                f"<br>{text}{extra}</figcaption></figure>")

    sections = []
    for title, idx in (("Most uncertain images", im_most), ("Least uncertain images", im_least)):
        cells = [cell(int(i), first_caption.get(int(i)),
                      f"&sigma;<sub>v</sub><sup>2</sup> = {img_s2[i]:.4g}") for i in idx]
        sections.append(f"<h2>{title}</h2><div class=grid>{''.join(cells)}</div>")
    for title, idx in (("Most uncertain captions", tx_most), ("Least uncertain captions", tx_least)):
        cells = [cell(int(cap_img[c]), int(c), f"&sigma;<sub>t</sub><sup>2</sup> = {txt_s2[c]:.4g}")
                 for c in idx]
        sections.append(f"<h2>{title}</h2><div class=grid>{''.join(cells)}</div>")
    page = ("<!doctype html><meta charset=utf-8><title>Uncertainty: "
            f"{html.escape(data.name)}</title><style>body{{font-family:sans-serif}}"
            ".grid{display:flex;flex-wrap:wrap;gap:8px}figure{width:"
            f"{thumb + 16}px;margin:0;font-size:12px}}</style>"
            f"<h1>{html.escape(data.name)}: {len(img_s2)} images, {len(txt_s2)} captions</h1>"
            "<p>&sigma;<sup>2</sup> = tr(&Sigma;) = &sum;<sub>d</sub> exp(log &sigma;<sub>d</sub>"
            "<sup>2</sup>) (paper §4.3, Fig. 4 / C.1); CSD of the image-caption pair, lower = "
            "closer.</p>" + "".join(sections))
    (out / "index.html").write_text(page)
    (out / "ranking.json").write_text(json.dumps(
        {**ranking, "image_sigma2_trace": img_s2.tolist(), "text_sigma2_trace": txt_s2.tolist()},
        indent=1))
    return ranking


def pca_ellipses(mu: np.ndarray, logvar: np.ndarray, labels: Sequence[str], path: str | Path,
                 kinds: Sequence[str] | None = None, samples: int = 10, seed: int = 0,
                 nstd: float = 2.0) -> dict[str, np.ndarray]:
    """The paper's Fig. 1 / A.2 picture: `samples` draws of every N(mu, diag sigma^2), PCA (a
    linear map, so Gaussians stay Gaussian: A.2) fitted on all draws, and per item its projected
    mean, its draws and the `nstd`-sigma ellipse of the projected covariance W diag(sigma^2) W^T.
    kinds: per item "image" / "text" (colour). Returns {"components" [2, D], "mean2d" [n, 2],
    "cov2d" [n, 2, 2]} and writes `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Ellipse

    mu, lv = np.asarray(mu, np.float64), np.asarray(logvar, np.float64)
    rng = np.random.default_rng(seed)
    draws = mu[:, None] + rng.standard_normal((len(mu), samples, mu.shape[1])) * np.exp(lv / 2)[:, None]
    flat = draws.reshape(-1, mu.shape[1])
    center = flat.mean(0)
    _, _, vt = np.linalg.svd(flat - center, full_matrices=False)
    w = vt[:2]                                              # [2, D] principal directions
    mean2d = (mu - center) @ w.T
    cov2d = np.einsum("kd,nd,ld->nkl", w, np.exp(lv), w)
    fig, ax = plt.subplots(figsize=(6, 6))
    colors = {"image": "tab:blue", "text": "tab:orange"}
    for i in range(len(mu)):
        color = colors.get((kinds or ["text"] * len(mu))[i], "tab:gray")
        pts = (draws[i] - center) @ w.T
        ax.scatter(pts[:, 0], pts[:, 1], s=6, color=color, alpha=0.5)
        vals, vecs = np.linalg.eigh(cov2d[i])
        angle = np.degrees(np.arctan2(vecs[1, -1], vecs[0, -1]))
        ax.add_patch(Ellipse(mean2d[i], *(2 * nstd * np.sqrt(np.maximum(vals[::-1], 0))), angle=angle,
                             fill=False, color=color))
        ax.annotate(str(labels[i])[:40], mean2d[i], fontsize=7)
    ax.set_xlabel("PC 1")
    ax.set_ylabel("PC 2")
    ax.set_title(f"PCA of {samples} samples per embedding ({nstd:g}-sigma ellipses)")
    ax.autoscale_view()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return {"components": w, "mean2d": mean2d, "cov2d": cov2d}
