"""Evaluate any checkpoint offline with the evaluators of an eval config.

    python scripts/evaluate.py --checkpoint CKPT --config configs/eval/demo.py --out DIR
    python scripts/evaluate.py --checkpoint CKPT --config configs/eval/imagefolder.py --out DIR \
        --config.root=/data/digits --config.split=val    # any field: --config.<field>=value
    python scripts/evaluate.py --checkpoint HF_DIR --config configs/eval/demo.py:evals=uncertainty --out DIR
    python scripts/evaluate.py --checkpoint CKPT --suite datacomp38 --data_dir DATA \
        --tokenizer sentencepiece:/data/c4_en.model --out DIR     # + DIR/suite.json, suite.md

CKPT is a training workdir, its checkpoints/ folder, one step folder or an exported Hugging
Face folder (config.json + model.safetensors), loaded with `prolip_jax.load` (the rule of every
tool, prolip_jax/core/artifacts.py). A non-empty DIR is refused unless --overwrite, which replaces
it; DIR is written beside itself and renamed into place when complete.

The config file defines `get_config(arg)` (arg after ':') with
`evals.<name> = dict(type="zeroshot" | "retrieval" | "uncertainty", ...)`;
`--config.<field>=value` overrides any of its fields, e.g. `--config.evals.zeroshot.num_images=500`
(an override naming no field is an error naming the nearest one, exit 2)
(big_vision style; `log_steps` is ignored here; `prefix` is prepended to the metric names, as
in training; the evaluators already name theirs "<type>/<dataset>/...").

Writes
    DIR/results.json      {"<prefix><metric>": value, ..., "<name>/seconds": wall time,
                          "throughput/images_per_second": ..., "checkpoint/step": N (prolip_jax
                          checkpoints)} (atomic; non-finite -> null)
    DIR/results.md        the same values as one markdown table (metric | value), in the order
                          the evaluators report them, e.g. retrieval/coco/csd/5k/i2t_R@1,
                          .../1k/rsum, .../eccv/mean_map_at_r, .../cxc/i2t_R@1,
                          .../5k/i2t_pmrp, .../1k/t2i_asp_tfidf, .../5k/i2t/unc_rho_R1
                          (configs/eval/coco.py, configs/eval/cub.py; evaluators/retrieval.py)
    DIR/<name>_*.png      sigma^2 histograms per modality, sigma^2 vs caption length, sigma^2 by
                          caption level (from the uncertainty evaluator's `arrays`); accuracy
                          per uncertainty bin from metrics named ".../unc_bin<i>_<what>" (the
                          zeroshot evaluator), or from `arrays` "bin_accuracy" [B] or
                          "correct" [N] + "uncertainty" [N].

Evaluators come from the registry `evaluators.REGISTRY` (the trainer's too): `Cls(config,
model)`, `run(params, progress)` yields (name, value); optional attributes `arrays` (per-item
numpy arrays of the run, plotted) and `encoder` (reused for the throughput measurement). On a
multi-host run (`jax.distributed.initialize()` before `evaluate()`) every host runs this and
gets the same numbers; only process 0 writes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python scripts/evaluate.py` from anywhere: find evaluators/
    sys.path.insert(0, str(ROOT))



def load_config(spec: str, overrides: list[str] = ()) -> Any:
    """'path/to/config.py[:arg]' -> get_config(arg) (big_vision style), with the
    `--config.<field>=value` overrides applied (as prolip_jax.train does for training).
    A missing file, a bad arg or an override naming no field raises a ValueError /
    FileNotFoundError whose message is one line naming the problem."""
    from prolip_jax.runtime import config_args

    config = config_args.load_config_file(spec)
    return apply_overrides(config, list(overrides))


def apply_overrides(config: Any, overrides: list[str]) -> Any:
    """`--config.a.b=value` items applied to an ml_collections config (values parsed by the
    field's type, as absl's config flags do); every item must name an existing field."""
    if not overrides:
        return config
    from absl import flags
    from ml_collections import config_flags

    from prolip_jax.runtime import config_args

    bad = [a for a in overrides if not a.startswith("--config.") or "=" not in a]
    if bad:
        raise ValueError(f"{bad[0]}: expected --config.<field>=<value>")
    config_args.check_overrides(config, overrides)
    argv = ["evaluate.py", *overrides]
    fv = flags.FlagValues()  # not absl's global FLAGS: main() can run twice in one process
    holder = config_flags.DEFINE_config_dict("config", config, lock_config=True, flag_values=fv,
                                             sys_argv=argv)
    fv(argv)
    return holder.value


def resolve_evaluators(evals: dict[str, dict], skip_missing: bool) -> dict[str, tuple[type, dict]]:
    """{name: (registered evaluator class, settings)}; an unknown type is an error naming the
    evaluator and the registered types (or a warning with --skip_missing)."""
    import evaluators

    out = {}
    for name, ecfg in evals.items():
        try:
            cls = evaluators.get(ecfg.get("type"))
        except ValueError as e:
            msg = f"config.evals.{name}: {e}"
            if skip_missing:
                print(f"warning: {msg}; skipped", file=sys.stderr)
                continue
            raise SystemExit(f"error: {msg}. Use --skip_missing to run the others.")
        out[name] = (cls, {"prefix": ecfg.get("prefix", "")})
    return out


def run_evaluator(evaluator: Any, params: Any, name: str) -> tuple[dict[str, Any], dict | None]:
    """-> (metrics, the evaluator's per-item arrays or None), with a per-item progress bar."""
    from tqdm import tqdm

    # disable=None: no bar when stderr is not a terminal (a log would get its escape codes)
    with tqdm(desc=f"  {name}", unit="item", leave=False, file=sys.stderr, disable=None) as bar:
        metrics = dict(evaluator.run(params, progress=bar.update))
    return metrics, getattr(evaluator, "arrays", None)


def image_throughput(encoder: Any, params: Any, image_size: int, batches: int = 2) -> float:
    """Images/s of a compiled, sharded image encoder on random inputs (one warm-up batch)."""
    import numpy as np

    x = np.random.default_rng(0).standard_normal((encoder.batch_size, image_size, image_size, 3),
                                                 dtype=np.float32)
    encoder.images(params, x)  # compile (or reuse) outside the timing
    x = np.concatenate([x] * batches)
    start = time.perf_counter()
    encoder.images(params, x)
    return len(x) / (time.perf_counter() - start)


def format_value(v: Any) -> str:
    """A metric for the markdown table: % and sums with 2 decimals, small values (correlations,
    losses) with 4 significant digits, integers and text as they are."""
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int) or (hasattr(v, "dtype") and getattr(v, "dtype").kind in "iu"):
        return str(int(v))
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    if not math.isfinite(f):
        return "n/a"
    return f"{f:.2f}" if abs(f) >= 1 else f"{f:.4g}"


def markdown_table(results: dict[str, Any], title: str = "") -> str:
    """One markdown table `| metric | value |` of a run's results, in their order."""
    lines = [f"# {title}", ""] if title else []
    lines += ["| metric | value |", "|---|---:|"]
    lines += [f"| {k} | {format_value(v)} |" for k, v in results.items()]
    return "\n".join(lines) + "\n"


def _jsonable(v: Any) -> Any:
    import numpy as np

    if isinstance(v, (np.ndarray, list, tuple)):
        return [_jsonable(x) for x in np.asarray(v).tolist()]
    if isinstance(v, (np.integer, int)) and not isinstance(v, bool):
        return int(v)
    if isinstance(v, (np.floating, float)):
        return float(v) if math.isfinite(v) else None
    return v


def write_json_atomic(path: Path, obj: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# ------------------------------------------------------------------------------ plots
def plot_uncertainty(arrays: dict, out: Path, name: str, plt: Any) -> list[Path]:
    """sigma^2 histograms per modality, sigma^2 vs caption length, sigma^2 by level (§4.3)."""
    import numpy as np

    written = []
    img, txt = np.asarray(arrays["image_sigma2"]), np.asarray(arrays["text_sigma2"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, values, label in ((axes[0], img, "image"), (axes[1], txt.ravel(), "text")):
        ax.hist(values, bins=30, color="tab:blue" if label == "image" else "tab:orange")
        ax.set_xlabel(r"$\sigma^2$ = tr($\Sigma$)")
        ax.set_ylabel("count")
        ax.set_title(f"{label} ({len(values)})")
        ax.tick_params(axis="x", labelrotation=30)
    written.append(_save(fig, out / f"{name}_sigma2_hist.png", plt))

    length = np.asarray(arrays["text_length"]).ravel()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.scatter(length, txt.ravel(), s=6, alpha=0.5)
    lengths = np.unique(length)
    ax.plot(lengths, [np.median(txt.ravel()[length == n]) for n in lengths], "k-", label="median")
    ax.set_xlabel("caption length (tokens)")
    ax.set_ylabel(r"text $\sigma^2$")
    ax.legend()
    written.append(_save(fig, out / f"{name}_sigma2_vs_length.png", plt))

    if txt.ndim == 2 and txt.shape[1] > 1:  # Fig. 7: sigma_t^2 by caption level
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.boxplot([txt[:, i] for i in range(txt.shape[1])])
        ax.set_xticks(range(1, txt.shape[1] + 1), [str(i) for i in range(txt.shape[1])])
        ax.set_xlabel("caption level (0: most general)")
        ax.set_ylabel(r"text $\sigma^2$")
        written.append(_save(fig, out / f"{name}_sigma2_by_level.png", plt))
    return written


BIN_METRIC = re.compile(r"^(?P<group>.*)/unc_bin(?P<bin>\d+)_(?P<what>\w+)$")


def binned_from_metrics(metrics: dict[str, Any]) -> dict[str, list[float]]:
    """{"<group>/<what>": accuracies (%) by bin} from metrics named "<group>/unc_bin<i>_<what>"."""
    found: dict[str, dict[int, float]] = {}
    for key, value in metrics.items():
        m = BIN_METRIC.match(key)
        if m:
            found.setdefault(f"{m['group']}/{m['what']}", {})[int(m["bin"])] = float(value)
    return {k: [v[i] for i in sorted(v)] for k, v in found.items()}


def binned_from_arrays(arrays: dict) -> list[float] | None:
    import numpy as np

    if "bin_accuracy" in arrays:   # in %, as every evaluator's accuracies (docs/metrics.md)
        return np.asarray(arrays["bin_accuracy"], np.float64).tolist()
    if "correct" in arrays and "uncertainty" in arrays:
        from evaluators.common import binned_accuracy

        return binned_accuracy(np.asarray(arrays["correct"]), np.asarray(arrays["uncertainty"]))[0].tolist()
    return None


def plot_binned_accuracy(series: dict[str, list[float]], path: Path, plt: Any) -> Path:
    """Accuracy per image-uncertainty bin (naver-ai/prolip src/prolip/zero_shot_classifier.py), one line per metric group."""
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for label, acc in series.items():
        ax.plot(range(len(acc)), acc, "o-", label=label)
    ax.set_xlabel("image uncertainty bin (0: least uncertain)")
    ax.set_ylabel("accuracy (%)")
    ax.legend(fontsize=7)
    return _save(fig, path, plt)


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def make_plots(collected: dict[str, dict], kinds: dict[str, str], metrics: dict[str, dict],
               out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("warning: matplotlib is not installed; no plots written", file=sys.stderr)
        return []
    written = []
    for name, kind in kinds.items():
        arrays = collected.get(name) or {}
        if "image_sigma2" in arrays:
            written += plot_uncertainty(arrays, out, name, plt)
        series = binned_from_metrics(metrics.get(name, {}))
        from_arrays = binned_from_arrays(arrays)
        if from_arrays is not None:
            series[name] = from_arrays
        if series:
            written.append(plot_binned_accuracy(series, out / f"{name}_accuracy_by_uncertainty.png", plt))
    return written


# ------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True,
                   help="training workdir, checkpoints folder (CKPT), step folder (CKPT/<step>) or exported folder")
    p.add_argument("--config", default="", help="eval config file[:arg], e.g. configs/eval/demo.py")
    p.add_argument("--suite", default="", choices=("", "datacomp38"),
                   help="run a task suite instead of --config (DataComp's 38 tasks; writes suite.json/.md)")
    p.add_argument("--data_dir", default="", help="--suite: folder holding the tasks' data")
    p.add_argument("--tfds_data_dir", default="", help="--suite: tfds data_dir (optional source)")
    p.add_argument("--tasks", default="", help="--suite: comma-separated task ids (default: all)")
    p.add_argument("--tokenizer", default="",
                   help="--suite: KIND:PATH for input_pipeline.tokenizers.build_tokenizer "
                        "(sentencepiece | hf | clip_bpe), e.g. sentencepiece:/data/c4_en.model")
    p.add_argument("--batch_size", type=int, default=256, help="--suite: images per batch")
    p.add_argument("--out", required=True, help="output directory (results.json, *.png)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--only", default="", help="comma-separated evaluator names to run (default: all)")
    p.add_argument("--skip_missing", action="store_true",
                   help="skip evaluator types that are not registered instead of stopping")
    p.add_argument("--no_plots", action="store_true")
    args, rest = p.parse_known_args(argv)
    # `--config.<field>=value` overrides any field of the eval config (bad ones: one line, exit 2).
    overrides = [a for a in rest if a.startswith("--config.")]
    if len(overrides) != len(rest):
        p.error(f"unrecognized arguments: {' '.join(a for a in rest if a not in overrides)}")

    if not args.suite and not args.config:
        raise SystemExit("error: give --config or --suite")
    from absl import flags

    try:
        config = suite_config(args) if args.suite else load_config(args.config)
        config = apply_overrides(config, overrides)
    except (flags.Error, ValueError, TypeError, FileNotFoundError, AttributeError, KeyError) as e:
        msg = e.args[0] if e.args and isinstance(e.args[0], str) else str(e)
        print("error: " + " ".join(msg.split()), file=sys.stderr)  # one line
        return 2
    only = args.only.split(",") if args.only else None
    try:
        evaluate(args.checkpoint, config, Path(args.out), step=args.step, only=only,
                 skip_missing=args.skip_missing, plots=not args.no_plots, overwrite=args.overwrite)
    except (ValueError, OSError) as e:  # data / class names / checkpoint / bucket (paths.BucketError): one line
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    return 0


def suite_config(args: argparse.Namespace) -> Any:
    """--suite: a one-evaluator config (type "datacomp38", evaluators/suite.py)."""
    import ml_collections as mlc

    if not args.data_dir:
        raise SystemExit("error: --suite needs --data_dir")
    ecfg = dict(type=args.suite, data_dir=args.data_dir, tfds_data_dir=args.tfds_data_dir,
                batch_size=args.batch_size)
    if args.tasks:
        ecfg["tasks"] = args.tasks.split(",")
    if args.tokenizer:
        kind, _, path = args.tokenizer.partition(":")
        if not path:
            raise SystemExit("error: --tokenizer is KIND:PATH, e.g. sentencepiece:/data/c4_en.model")
        ecfg["tokenizer"] = dict(kind=kind, path=path)
    c = mlc.ConfigDict()
    c.evals = mlc.ConfigDict({"suite": ecfg})
    return c


def evaluate(checkpoint: str, config: Any, out: Path, step: int | None = None,
             only: list[str] | None = None, skip_missing: bool = False,
             plots: bool = True, overwrite: bool | None = None) -> dict[str, Any]:
    """Runs `config.evals` on a checkpoint, writes out/results.json (+ plots); returns the results.
    `out` is written beside itself and replaces any earlier `out` only when complete.
    overwrite: False refuses a non-empty `out` (before the model loads), True / None replace it."""
    evals = {k: (v.to_dict() if hasattr(v, "to_dict") else dict(v)) for k, v in config.evals.items()}
    if only:
        missing = sorted(set(only) - set(evals))
        if missing:
            raise SystemExit(f"error: --only names {missing} not in config.evals ({sorted(evals)})")
        evals = {k: evals[k] for k in only}
    modules = resolve_evaluators(evals, skip_missing)  # fail before the (slow) load
    if not modules:
        raise SystemExit("error: no evaluator to run")
    from prolip_jax.runtime import paths
    from prolip_jax.core import artifacts

    artifacts.check_out(out, overwrite is not False)

    import jax
    import prolip_jax
    from prolip_jax.trainer.build import EVAL_KEYS  # a run's settings of an evaluator, not its config
    from tqdm import tqdm

    model = prolip_jax.load(checkpoint, step=step)
    params = model.params  # each evaluator's Encoder places them on its devices
    print(f"loaded {checkpoint}: embed_dim {model.config.embed_dim}, image "
          f"{model.config.vision.image_size}px, context {model.config.text.context_length}")

    results: dict[str, Any] = {}
    if model.step is not None:
        results["checkpoint/step"] = model.step
    collected: dict[str, dict] = {}
    per_eval: dict[str, dict] = {}
    suites: dict[str, Any] = {}   # evaluators with a task table (`rows`)
    encoder = None
    bars = sys.stderr.isatty()  # tqdm's disable=None: bars on a terminal only, else a line per evaluator
    for i, (name, (cls, settings)) in enumerate(tqdm(modules.items(), desc="evaluators", file=sys.stderr,
                                                     disable=None)):
        if not bars:
            print(f"evaluating {name} ({i + 1}/{len(modules)})", file=sys.stderr, flush=True)
        ecfg = {k: v for k, v in evals[name].items() if k not in EVAL_KEYS}
        start = time.perf_counter()
        # The tokenizer recorded with the model, unless the eval config names one.
        tokenizer = None if (ecfg.get("tokenizer") or {}).get("path") else model.tokenizer
        evaluator = cls(ecfg, model.module, tokenizer)
        metrics, arrays = run_evaluator(evaluator, params, name)
        results.update({settings["prefix"] + k: v for k, v in metrics.items()})
        results[f"{name}/seconds"] = time.perf_counter() - start
        per_eval[name] = metrics
        if arrays is not None:
            collected[name] = arrays
        encoder = encoder or getattr(evaluator, "encoder", None)
        if hasattr(evaluator, "rows"):
            suites[name] = evaluator
    for k, v in results.items():
        print(f"  {k}: {v:.6g}" if isinstance(v, float) else f"  {k}: {v}")

    if encoder is None:
        from evaluators.common import Encoder

        encoder = Encoder(model.module)
    ips = image_throughput(encoder, params, model.config.vision.image_size)
    results["throughput/images_per_second"] = ips
    print(f"image encoding: {ips:.1f} images/s ({encoder.batch_size} per batch, "
          f"{len(encoder.mesh.devices.ravel())} devices)")

    if jax.process_index() != 0:   # every host has the same results; one writes them
        return results
    out = Path(out)
    with paths.replacing_folder(out) as tmp:
        tmp.mkdir()  # a plain mkdir: the folder gets the usual permissions
        write_json_atomic(tmp / "results.json", {k: _jsonable(v) for k, v in results.items()})
        (tmp / "results.md").write_text(markdown_table(results, f"{checkpoint}"))
        for name, ev in suites.items():   # the suite's table: suite.json + suite.md
            from evaluators.suite import write_tables

            write_tables(ev.rows, tmp, {"checkpoint": str(checkpoint), "evaluator": name})
        written = make_plots(collected, {n: evals[n]["type"] for n in modules}, per_eval, tmp) if plots else []
    if suites:
        print(f"wrote {out / 'suite.md'}")
    print(f"wrote {out / 'results.json'}, {out / 'results.md'} ({len(results)} values) and "
          f"{len(written)} plots")
    return results


if __name__ == "__main__":
    sys.exit(main())
