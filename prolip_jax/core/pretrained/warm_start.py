"""Warm start: an imported model (CLIP, SigLIP, ProLIP, ...) as the initialisation of a ProLIP.

    params, report = init_from_config(config.init, model_config, fresh_params)
    if report is not None:
        print(report.table()); report.write(workdir)      # after success only

Every target parameter is one of
    loaded   same path and shape in the source: copied
    resized  same thing at another size: image / text position embeddings, token embedding
    new      not in the source: keeps the target's fresh initialisation, which is the
             reference's (vit.py / text.py: [UNC] tokens, uncertainty projections with bias
             -10, [CLS] where the source had a MAP head, CLIP's missing text_projection bias)
    fresh    in the source but matched by `config.init.fresh`: keeps the target's fresh
             initialisation at any shape (PCME++'s new 1024-d projections on CLIP's trunks)
and every source parameter without a place in the target (SigLIP's MAP head and patch bias,
...) is `dropped`. Anything else whose shape differs (another width, layer count, patch
size) is an unexpected mismatch: a ValueError giving their count and the first few with both
shapes (an example of each kind of misfit first), raised before any array is touched.

Sizes are adapted as naver-ai/prolip's `factory.load_checkpoint` does (src/prolip/model.py
`resize_prolip_pos_embed`, `resize_prolip_text_pos_embed`, `resize_prolip_tok_embed`; see
`_image_positions`, `_text_positions`, `_token_embedding` for the few deliberate deviations).
Works on host float32 numpy arrays; the caller device_puts the result with its shardings.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Callable, Literal, Mapping

import numpy as np

from prolip_jax.runtime import paths
from prolip_jax.runtime import messages
from prolip_jax.core.models.config import ProLIPConfig
from prolip_jax.core.models.layout import layout_of, to_layout
from prolip_jax.core.pretrained.loader import load_pretrained

# `config.init` knobs (the trainer's config section; ml_collections cannot hold None, hence "").
@dataclasses.dataclass(frozen=True)
class InitConfig:
    """`config.init`: a pretrained model to start from."""

    # A file (.safetensors, .npz), a folder (Hugging Face / open_clip layout, a prolip_jax
    # checkpoint) or a Hugging Face repo id. "" = no warm start.
    path: str = ""
    # 'auto' detects the family; or 'prolip' | 'open_clip' | 'timm_siglip' | 'big_vision'.
    format: str = "auto"
    # The source architecture when the files do not carry it (an open_clip model name such as
    # 'ViT-B-32-quickgelu', or a ProLIP variant name); "" = read it from the files.
    arch: str = ""
    # Text position rows kept as they are before the rest is linearly interpolated to another
    # context length (LongProLIP / Long-CLIP: 20). 0 = interpolate every token row.
    text_pos_keep: int = 20
    # Rows of a larger target vocabulary: 'zeros' (the zero padding) or 'fresh' (the
    # target's initialisation, which is what naver-ai/prolip `resize_prolip_tok_embed` does).
    vocab_pad: Literal["zeros", "fresh"] = "zeros"
    # Regexes (re.search on paths such as 'visual/proj', 'text/text_projection/kernel'): target
    # parameters that keep their fresh initialisation although the source has them, at any shape.
    # PCME++ (App. B.2; naver-ai/pcmepp `embed_size: 1024`) puts a new 1024-d Linear on
    # CLIP's 512-d trunks: `model.embed_dim=1024` plus fresh=("^visual/proj$", "^text/text_projection/").
    fresh: tuple[str, ...] = ()

    def validate(self) -> None:
        resolve_init_config(dataclasses.asdict(self))


DEFAULTS = dataclasses.asdict(InitConfig())

KINDS = ("loaded", "resized", "new", "fresh", "dropped")

# Parameters that exist only with some architecture options (VisionConfig / TextConfig fields),
# so a source or a target may lack them. Any other difference in the parameter set means
# another architecture (layer count, ...) and is an error.
_OPTIONAL = re.compile(
    r"^(visual/(class_embedding|unc_embedding|uncertainty_proj/.*|patch_bias|map_head/.*|ln_pre/.*|proj)"
    r"|text/(cls_emb|unc_emb|text_uncertainty_projection/.*|text_projection/bias)"
    r"|logit_bias"
    # PCME++ / Pishdad et al. heads (models/heads.py): new in a model warm-started from CLIP, the
    # duplicated block at its random init as PCME++ starts it (PCME++ §2.4).
    r"|(visual|text)/(unc_transformer|unc_projection|gpo|unc_gpo)/.*)$")
_RESIZABLE = ("visual/positional_embedding", "text/positional_embedding", "text/token_embedding")


@dataclasses.dataclass(frozen=True)
class Row:
    kind: str  # one of KINDS
    name: str  # 'visual/transformer/resblocks_0/ln_1/scale'
    shape: tuple[int, ...] | None  # in the target (None: dropped)
    source_shape: tuple[int, ...] | None  # in the source (None: new)
    note: str = ""


@dataclasses.dataclass
class WarmStartReport:
    source: str
    format: str
    rows: list[Row]

    def counts(self) -> dict[str, int]:
        return {k: sum(r.kind == k for r in self.rows) for k in KINDS}

    def summary(self) -> str:
        counts = ", ".join(f"{n} {k}" for k, n in self.counts().items() if n or k != "fresh")
        return f"warm start from {self.source} ({self.format}): {counts}"

    def table(self) -> str:
        """The rows as text, transformer blocks collapsed (`resblocks_{0..11}/ln_1/scale`)."""
        groups: dict[tuple, list[int]] = {}
        for r in self.rows:
            m = re.search(r"resblocks_(\d+)", r.name)
            key = (r.kind, re.sub(r"resblocks_\d+", "resblocks_#", r.name), r.shape, r.source_shape, r.note)
            groups.setdefault(key, []).append(int(m.group(1)) if m else -1)
        lines = []
        for (kind, name, shape, src_shape, note), blocks in sorted(groups.items(), key=lambda g: (KINDS.index(g[0][0]), g[0][1])):
            name = name.replace("resblocks_#", f"resblocks_{_span(blocks)}")
            lines.append((kind, name, _shape(shape), _shape(src_shape), note))
        head = ("kind", "parameter", "shape", "source shape", "note")
        widths = [max(len(x[i]) for x in [head] + lines) for i in range(4)]
        fmt = lambda x: "  ".join(s.ljust(w) for s, w in zip(x[:4], widths)) + ("  " + x[4] if x[4] else "")
        return "\n".join([self.summary(), fmt(head)] + [fmt(x).rstrip() for x in lines])

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "format": self.format, "counts": self.counts(),
                "params": [dataclasses.asdict(r) for r in self.rows]}

    def write(self, directory: str | os.PathLike) -> None:
        """`warm_start.txt` (the table) and `warm_start.json` (every row) in `directory`."""
        paths.makedirs(directory)  # local or a bucket (prolip_jax/runtime/paths.py)
        paths.write_text_atomic(paths.join(directory, "warm_start.txt"), self.table() + "\n")
        paths.write_text_atomic(paths.join(directory, "warm_start.json"), json.dumps(self.to_json(), indent=1) + "\n")


def _span(blocks: list[int]) -> str:
    if blocks == [-1] or len(blocks) == 1:
        return str(blocks[0])
    if blocks == list(range(blocks[0], blocks[-1] + 1)):
        return f"{{{blocks[0]}..{blocks[-1]}}}"
    return "{" + ",".join(map(str, blocks)) + "}"


def _shape(shape: tuple[int, ...] | None) -> str:
    return "-" if shape is None else str(tuple(shape))


# ------------------------------------------------------------------------------------------
# Entry points
# ------------------------------------------------------------------------------------------
def resolve_init_config(init_cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """DEFAULTS updated from `init_cfg` (a dict or ConfigDict); unknown keys are an error."""
    cfg = dict(DEFAULTS)
    given = {k: init_cfg[k] for k in init_cfg.keys()} if init_cfg else {}
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown config.init key(s) {unknown}; known: {sorted(DEFAULTS)}")
    cfg.update(given)
    if cfg["vocab_pad"] not in ("zeros", "fresh"):
        raise ValueError(f"config.init.vocab_pad={cfg['vocab_pad']!r} is not 'zeros' or 'fresh'")
    if int(cfg["text_pos_keep"]) < 0:
        raise ValueError(f"config.init.text_pos_keep={cfg['text_pos_keep']} must be >= 0")
    if isinstance(cfg["fresh"], str):
        raise ValueError(f"config.init.fresh={cfg['fresh']!r} must be a tuple of regexes, not a string")
    cfg["fresh"] = tuple(cfg["fresh"])
    for pattern in cfg["fresh"]:
        try:
            re.compile(pattern)
        except (re.error, TypeError) as e:
            raise ValueError(f"config.init.fresh: {pattern!r} is not a regular expression ({e})") from None
    return cfg


def init_from_config(init_cfg: Mapping[str, Any] | None, target: ProLIPConfig, fresh_params: Mapping[str, Any]
                     ) -> tuple[dict, WarmStartReport | None]:
    """(params, report) from `config.init` (keys: DEFAULTS); (fresh_params, None) if no path.

    Imports the source with `load_pretrained` (local files or the hub cache) and warm-starts
    `target` from it. Raises ValueError / FileNotFoundError for a bad source or a mismatch;
    writes nothing (the caller writes `report` once the run is set up).
    """
    apply = prepare(init_cfg, target, fresh_params)
    return (fresh_params, None) if apply is None else apply(fresh_params)


def prepare(init_cfg: InitConfig | Mapping[str, Any] | None, target: ProLIPConfig, param_shapes: Mapping[str, Any]
            ) -> Callable[[Mapping[str, Any]], tuple[dict, WarmStartReport]] | None:
    """Imports the source of `config.init` and checks it against the target's parameter shapes
    (anything with `.shape`: `jax.eval_shape` output will do), so a bad source or an unexpected
    mismatch stops a run before anything compiles. Returns `apply(fresh_params) -> (params,
    report)`, or None when `init_cfg` has no path. The trainer passes its parsed InitConfig;
    a mapping (a library caller's, whose `arch` may also be a ProLIPConfig) is resolved here."""
    cfg = dataclasses.asdict(init_cfg) if isinstance(init_cfg, InitConfig) else resolve_init_config(init_cfg)
    if not cfg["path"]:
        return None
    src_config, src_params, imported = load_pretrained(cfg["path"], format=cfg["format"], arch=cfg["arch"] or None)
    absent = tuple(imported.filled)
    check_fit(target, param_shapes, src_config, {k: v for k, v in _flatten(src_params).items() if k not in absent},
              int(cfg["text_pos_keep"]), cfg["fresh"])

    def apply(fresh_params: Mapping[str, Any]) -> tuple[dict, WarmStartReport]:
        return warm_start(target, fresh_params, src_config, src_params, source_absent=absent,
                          text_pos_keep=int(cfg["text_pos_keep"]), vocab_pad=cfg["vocab_pad"],
                          fresh=cfg["fresh"], source=imported.source, format=imported.format)

    return apply


def check_fit(target: ProLIPConfig, param_shapes: Mapping[str, Any], source_config: ProLIPConfig,
              source_shapes: Mapping[str, Any], text_pos_keep: int = DEFAULTS["text_pos_keep"],
              fresh: tuple[str, ...] = ()) -> None:
    """Raises the ValueError `warm_start` would raise, from shapes alone (anything with `.shape`)."""
    param_shapes, source_shapes = to_layout(param_shapes, False), to_layout(source_shapes, False)
    _check(_flatten(param_shapes, as_array=False), _flatten(source_shapes, as_array=False), fresh)
    _check_text_keep(target, source_config, text_pos_keep)


def warm_start(target: ProLIPConfig, fresh_params: Mapping[str, Any], source_config: ProLIPConfig,
               source_params: Mapping[str, Any], *, source_absent: tuple[str, ...] = (),
               text_pos_keep: int = 20, vocab_pad: str = "zeros", fresh: tuple[str, ...] = (),
               source: str = "source", format: str = "") -> tuple[dict, WarmStartReport]:
    """Target params (host float32 numpy, the tree of `fresh_params`, in its block layout:
    models/layout.py) + the report, which names blocks unrolled whatever the layouts.

    target / fresh_params: the model to train and its fresh initialisation (`init_params`).
    source_config / source_params: an imported model (`load_pretrained`), any family.
    source_absent: paths the importer filled in without the source having them (its
      `ImportReport.filled`, e.g. OpenAI CLIP's 'logit_bias'): treated as absent.
    text_pos_keep, vocab_pad, fresh: see InitConfig.
    """
    keep_fresh, fresh_patterns = _matcher(fresh), tuple(fresh)
    scanned = bool(layout_of(fresh_params))
    fresh = _flatten(to_layout(fresh_params, False))
    src = {k: v for k, v in _flatten(to_layout(source_params, False)).items() if k not in source_absent}
    _check(fresh, src, fresh_patterns)

    out: dict[str, np.ndarray] = {}
    rows: list[Row] = []
    for name, init in fresh.items():
        if name in src and keep_fresh.pattern and keep_fresh.search(name):
            out[name], kind, note = init, "fresh", "config.init.fresh: the target's initialisation"
        elif name == "visual/positional_embedding":
            out[name], kind, note = _image_positions(target, init, source_config, src[name])
        elif name == "text/positional_embedding":
            out[name], kind, note = _text_positions(target, init, source_config, src[name], text_pos_keep)
        elif name == "text/token_embedding":
            out[name], kind, note = _token_embedding(init, src[name], vocab_pad)
        elif name == "logit_scale" and "logit_bias" in fresh and "logit_bias" not in src:
            # naver-ai/prolip factory.load_checkpoint: a checkpoint without logit_bias (CLIP) gets
            # SigLIP's initial a = 10, b = -10 (the paper's init, our config default).
            out[name], kind, note = init, "new", "reset to the target's init: the source has no logit_bias (as the reference)"
        elif name in src:
            out[name], kind, note = src[name], "loaded", ""
        else:
            out[name], kind, note = init, "new", "target's initialisation"
        rows.append(Row(kind, name, init.shape, src[name].shape if name in src else None, note))
        if kind == "loaded" and init.shape != out[name].shape:
            raise AssertionError(f"internal: {name} loaded with shape {out[name].shape} != {init.shape}")
    rows += [Row("dropped", k, None, v.shape, "no place in the target") for k, v in src.items() if k not in fresh]
    params = _unflatten({k: np.asarray(v, np.float32) for k, v in out.items()})
    return to_layout(params, scanned), WarmStartReport(source, format or "params", rows)


def _matcher(patterns: tuple[str, ...]) -> re.Pattern:
    """One regex for config.init.fresh's patterns (an empty pattern when there are none)."""
    return re.compile("|".join(f"(?:{p})" for p in patterns))


def _check(fresh: Mapping[str, np.ndarray], src: Mapping[str, np.ndarray], fresh_patterns: tuple[str, ...] = ()
           ) -> None:
    """Every difference must be one warm_start knows how to bridge; else one short error: the
    count, an example of each kind of misfit first, then a few more, and the flags to change."""
    problems: list[tuple[str, str]] = []  # (kind of misfit, text)
    fresh_match = _matcher(fresh_patterns)
    if fresh_patterns and not any(fresh_match.search(n) for n in set(fresh) & set(src)):
        raise ValueError(f"config.init.fresh={fresh_patterns!r} matches no parameter that the source and the target "
                         "share (paths look like 'visual/proj', 'text/text_projection/kernel')")
    for name in sorted(set(fresh) | set(src)):
        if name in fresh and name in src and fresh_match.pattern and fresh_match.search(name):
            continue   # keeps the target's init: any shape
        if name in fresh and name in src:
            a, b = fresh[name].shape, src[name].shape
            if name in _RESIZABLE:
                if a[-1] != b[-1]:
                    problems.append(("width", f"{name}: target {a}, source {b} (the width differs)"))
                elif name == "text/token_embedding" and a[0] < b[0]:
                    problems.append(("vocab", f"{name}: target {a}, source {b} (a smaller vocabulary: a warm "
                                              "start only pads one)"))
            elif a != b:
                problems.append(("shape", f"{name}: target {a}, source {b}"))
        elif not _OPTIONAL.match(name):
            where, shape = ("target", fresh[name].shape) if name in fresh else ("source", src[name].shape)
            problems.append((where, f"{name}: only in the {where} {shape}"))
    if problems:
        first: dict[str, str] = {}
        for kind, text in problems:
            first.setdefault(kind, text)  # an example of each kind of misfit leads
        ordered = [*first.values(), *(text for _, text in problems if text not in first.values())]
        raise ValueError(f"warm start: {len(problems)} parameter(s) of the source do not fit the target model "
                         f"(another width, layer count, patch size or an unknown family?): "
                         f"{messages.few(ordered, 3, '; ')}. Point --config.init.path at a model of this "
                         "architecture or set --config.model.variant (or --config.model.config_json) to the "
                         "source's; --config.init.fresh keeps chosen parameters at their fresh initialisation")


# ------------------------------------------------------------------------------------------
# Resizes
# ------------------------------------------------------------------------------------------
def _image_positions(target: ProLIPConfig, init: np.ndarray, source: ProLIPConfig, old: np.ndarray):
    """Rows [CLS]? [UNC]? patches (vit.py). Patch rows are resized on their 2-D grid with
    PyTorch's antialiased bicubic (naver-ai/prolip resize_prolip_pos_embed, as open_clip
    resize_pos_embed: F.interpolate(mode='bicubic', antialias=True, align_corners=False)).
    The extra rows keep the target's init except [CLS] copied from a source that has one
    (the reference takes `model.positional_embedding[:2]` and copies row 0 from a 197/257-row
    CLIP; it finds the layout from the row count, we from the source config)."""
    sv, tv = source.vision, target.vision
    s_pre, t_pre = int(sv.class_token) + int(sv.unc_token), int(tv.class_token) + int(tv.unc_token)
    if old.shape[0] != s_pre + sv.num_patches:
        raise ValueError(f"visual/positional_embedding of the source has {old.shape[0]} rows, its config says "
                         f"{s_pre} + {sv.grid}^2")
    new = np.array(init, np.float64)
    notes = []
    for token, s_has, t_has, s_row, t_row in (("CLS", sv.class_token, tv.class_token, 0, 0),
                                              ("UNC", sv.unc_token, tv.unc_token, int(sv.class_token), int(tv.class_token))):
        if t_has:
            if s_has:
                new[t_row] = old[s_row]
            notes.append(f"{token} row {'copied' if s_has else 'new'}")
        elif s_has:
            notes.append(f"{token} row dropped")
    patches = old[s_pre:].reshape(sv.grid, sv.grid, -1).astype(np.float64)
    if sv.grid != tv.grid:
        m = bicubic_aa_matrix(sv.grid, tv.grid)
        patches = np.einsum("ij,kl,jld->ikd", m, m, patches)
        notes.insert(0, f"patch grid {sv.grid}x{sv.grid} -> {tv.grid}x{tv.grid} (bicubic, antialias)")
    new[t_pre:] = patches.reshape(tv.num_patches, -1)
    same = (sv.grid, sv.class_token, sv.unc_token) == (tv.grid, tv.class_token, tv.unc_token)
    return new.astype(np.float32), "loaded" if same else "resized", "" if same else "; ".join(notes)


def _text_positions(target: ProLIPConfig, init: np.ndarray, source: ProLIPConfig, old: np.ndarray, keep: int):
    """Rows t_0..t_{L-1} [UNC] [CLS] for ProLIP, t_0..t_{L-1} otherwise (text.py).

    Token rows: the first `keep` kept, the rest linearly interpolated (F.interpolate
    mode='linear', align_corners=False, no antialias) to the new length, the way
    naver-ai/prolip resize_prolip_text_pos_embed does for LongProLIP (keep = 20). [UNC]/[CLS]
    rows are carried over from a ProLIP source, else keep the target's init. Deviation: the
    reference uses that rule only for targets over 127 rows and otherwise interpolates all
    rows, [UNC]/[CLS] included; here they are never mixed with token positions."""
    s_extra, t_extra = 2 * (source.text.pool == "prolip"), 2 * (target.text.pool == "prolip")
    ls, lt = source.text.context_length, target.text.context_length
    if old.shape[0] != ls + s_extra:
        raise ValueError(f"text/positional_embedding of the source has {old.shape[0]} rows, its config says "
                         f"{ls} + {s_extra}")
    new = np.array(init, np.float64)
    tokens = old[:ls].astype(np.float64)
    notes = []
    if ls != lt:
        k = min(keep, lt)
        _check_text_keep(target, source, keep)
        rest = linear_matrix(ls - k, lt - k) @ tokens[k:] if lt > k else tokens[:0]
        tokens = np.concatenate([tokens[:k], rest])
        notes.append(f"context {ls} -> {lt} (first {k} kept, the rest linear)")
    new[:lt] = tokens
    if t_extra:
        if s_extra:
            new[lt:] = old[ls:]
        notes.append(f"UNC/CLS rows {'copied' if s_extra else 'new'}")
    elif s_extra:
        notes.append("UNC/CLS rows dropped")
    same = (ls, s_extra) == (lt, t_extra)
    return new.astype(np.float32), "loaded" if same else "resized", "" if same else "; ".join(notes)


def _check_text_keep(target: ProLIPConfig, source: ProLIPConfig, keep: int) -> None:
    ls, lt = source.text.context_length, target.text.context_length
    if lt > ls and min(keep, lt) >= ls:
        raise ValueError(f"text positions {ls} -> {lt}: init.text_pos_keep={keep} keeps every source row and "
                         f"leaves none to interpolate; set it below {ls}")


def _token_embedding(init: np.ndarray, old: np.ndarray, pad: str):
    """A larger target vocabulary: the source rows first, then zeros ('zeros') or the target's
    init ('fresh': naver-ai/prolip resize_prolip_tok_embed copies into a clone of the model's
    table). A smaller one is an error (the reference raises NotImplementedError)."""
    vs, vt = old.shape[0], init.shape[0]
    if vs == vt:
        return old, "loaded", ""
    if vs > vt:
        raise ValueError(f"text/token_embedding: the target vocabulary ({vt}) is smaller than the source's ({vs}); "
                         "a warm start only pads a vocabulary")
    new = np.zeros_like(init) if pad == "zeros" else np.array(init)
    new[:vs] = old
    return new, "resized", f"vocabulary {vs} -> {vt} ({'zero' if pad == 'zeros' else 'init'}-padded)"


def _cubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    """Keys' cubic kernel; PyTorch's antialiased bicubic uses a = -0.5 (PIL's), the plain one -0.75."""
    x = np.abs(x)
    return np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                    np.where(x < 2, ((a * x - 5 * a) * x + 8 * a) * x - 4 * a, 0.0))


def bicubic_aa_matrix(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in] float64 weights of F.interpolate(mode='bicubic', antialias=True,
    align_corners=False) along one axis (ATen UpSampleKernel.cpp
    `_compute_indices_min_size_weights_aa`): support 2*max(scale, 1), taps cut at the borders
    and renormalised."""
    scale = n_in / n_out
    support = 2.0 * max(scale, 1.0)
    inv = 1.0 / scale if scale >= 1.0 else 1.0
    m = np.zeros((n_out, n_in))
    for i in range(n_out):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)  # int() truncates like static_cast<int64_t>
        hi = min(int(center + support + 0.5), n_in)
        w = _cubic((np.arange(lo, hi) - center + 0.5) * inv)
        m[i, lo:hi] = w / w.sum() if w.sum() != 0 else w
    return m


def linear_matrix(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in] float64 weights of F.interpolate(mode='linear', align_corners=False)
    (ATen area_pixel_compute_source_index: src = max(scale*(i+0.5) - 0.5, 0))."""
    scale = n_in / n_out
    m = np.zeros((n_out, n_in))
    for i in range(n_out):
        s = max(scale * (i + 0.5) - 0.5, 0.0)
        i0 = min(int(s), n_in - 1)
        i1 = min(i0 + 1, n_in - 1)
        lam = min(max(s - i0, 0.0), 1.0)
        m[i, i0] += 1.0 - lam
        m[i, i1] += lam
    return m


# ------------------------------------------------------------------------------------------
def _flatten(tree: Mapping[str, Any], prefix: str = "", as_array: bool = True) -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}/", as_array))
        else:
            out[f"{prefix}{k}"] = np.asarray(v, np.float32) if as_array else v
    return out


def _unflatten(flat: Mapping[str, np.ndarray]) -> dict:
    tree: dict = {}
    for path, v in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return tree
