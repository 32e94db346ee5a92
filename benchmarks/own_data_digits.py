r"""The README's own-data recipe, word for word, on a small real image-caption set, over seeds.

    pip install scikit-learn                                   # only for its bundled digits file
    python benchmarks/own_data_digits.py --out /tmp/digits     # seeds 0,1,2 (~25 min each on 2 cores)
    python benchmarks/own_data_digits.py --out /tmp/d --seeds 0 --steps 1000

The set: the UCI "Optical Recognition of Handwritten Digits" images (1,797 scans, 8x8, ten
classes; scikit-learn ships them as `sklearn/datasets/data/digits.csv.gz`, or pass that file
with --digits-csv). A fixed stratified split: 1,297 images as PNG + caption tar shards for
training (one caption per image from a few templates, e.g. "a scan of a handwritten number
seven"), 500 as an ImageFolder (`val/<zero..nine>/*.png`) for zero-shot evaluation.

Then, each as its own process, the commands of the README's "Your own data" section:
scripts/train_tokenizer.py, scripts/tar_to_array_record.py, `python -m prolip_jax.train
--config configs/own_data.py:zeroshot=DIGITS` (one workdir per seed, `--config.seed=N`), and
scripts/evaluate.py with configs/eval/imagefolder.py. It writes OUT/results.md and
OUT/results.json: per seed the final zero-shot top-1, the step at which held-out zero-shot
first passed 50% (from the run's own evaluations every --eval-every steps) and loss/ppcl at
step 300; with the mean and the half range (max - min) / 2 (results.json also has each run's
wall seconds and its zero-shot curve). A logistic regression on
the same pixels and split is printed beside them as the supervised reference. A rerun reuses
the data, the tokenizer and every finished seed.
"""
from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from input_pipeline import synthetic  # noqa: E402
from prolip_jax.runtime import metrics  # noqa: E402

NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
TEMPLATES = ("a scan of a handwritten number {}", "the digit {}", "a handwritten {}",
             "a photo of the number {}", "{} written by hand")
NUM_VAL = 500
NUM_SHARDS = 4


def digits_csv(given: str) -> Path:
    if given:
        return Path(given)
    try:
        import sklearn.datasets
    except ImportError:
        sys.exit("error: the digits come from scikit-learn's bundled file: pip install scikit-learn, "
                 "or pass --digits-csv PATH/digits.csv.gz")
    return Path(sklearn.datasets.__file__).parent / "data" / "digits.csv.gz"


def load_digits(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [N, 8, 8] in 0..255, labels [N]) from the 65-column CSV (64 pixels 0..16, label)."""
    with gzip.open(path, "rt") if path.suffix == ".gz" else open(path) as f:
        rows = np.loadtxt(f, delimiter=",", dtype=np.int64)
    images = (rows[:, :64].reshape(-1, 8, 8) * 255 // 16).astype(np.uint8)
    return images, rows[:, 64]


def split(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A fixed stratified split: NUM_VAL held-out images, 50 per class."""
    rng = np.random.default_rng(0)
    val = np.concatenate([rng.permutation(np.flatnonzero(labels == c))[:NUM_VAL // 10] for c in range(10)])
    train = np.setdiff1d(np.arange(len(labels)), val)
    return rng.permutation(train), np.sort(val)


def png(image: np.ndarray) -> bytes:
    return synthetic.encode_image(np.repeat(image[..., None], 3, axis=-1), "PNG")


def write_data(out: Path, images: np.ndarray, labels: np.ndarray) -> Path:
    data = out / "data"
    if (data / "done").exists():
        return data
    train, val = split(labels)
    rng = np.random.default_rng(1)
    (data / "shards").mkdir(parents=True, exist_ok=True)
    for s, part in enumerate(np.array_split(train, NUM_SHARDS)):
        members = []
        for i in part:
            caption = TEMPLATES[rng.integers(len(TEMPLATES))].format(NAMES[labels[i]])
            members += synthetic.record_members(f"{i:05d}", {"png": png(images[i]), "txt": caption.encode()})
        synthetic.write_tar(str(data / "shards" / f"train-{s:04d}.tar"), members)
    for i in val:
        folder = data / "digits" / "val" / NAMES[labels[i]]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[i]).convert("RGB").save(folder / f"{i:05d}.png")
    (data / "done").write_text("")
    return data


def logistic_regression(images: np.ndarray, labels: np.ndarray) -> float | None:
    """Held-out top-1 (%) of a supervised logistic regression on the raw pixels (None without sklearn)."""
    try:
        from sklearn.linear_model import LogisticRegression
    except ImportError:
        return None
    train, val = split(labels)
    x = images.reshape(len(images), -1) / 255.0
    clf = LogisticRegression(max_iter=2000).fit(x[train], labels[train])
    return 100.0 * float((clf.predict(x[val]) == labels[val]).mean())


def run(cmd: list[str], log: Path) -> None:
    print("+", " ".join(cmd), flush=True)
    with open(log, "a") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode:
        sys.exit(f"error: the command above failed (exit {done.returncode}); its output: {log}")


def prepare(data: Path) -> None:
    """The README's tokenizer and ArrayRecord commands (once)."""
    py = sys.executable
    if not (data / "tokenizer.model").exists():
        run([py, "scripts/train_tokenizer.py", "--input", str(data / "shards" / "*.tar"),
             "--output", str(data / "tokenizer.model"), "--context_length", "16"], data / "prepare.log")
    if not (data / "arrayrecord").exists():
        run([py, "scripts/tar_to_array_record.py", "--input", str(data / "shards" / "*.tar"),
             "--output", str(data / "arrayrecord")], data / "prepare.log")


def train_seed(out: Path, data: Path, seed: int, steps: int, eval_every: int, extra: list[str]) -> dict:
    wd = out / f"seed{seed}"
    result_file = wd / "result.json"
    if result_file.exists():
        return json.loads(result_file.read_text())
    py = sys.executable
    start = time.time()
    run([py, "-m", "prolip_jax.train", "--config", f"configs/own_data.py:zeroshot={data / 'digits'},steps={steps}",
         "--workdir", str(wd), f"--config.data.path={data / 'arrayrecord'}/*.array_record",
         f"--config.data.tokenizer.path={data / 'tokenizer.model'}", f"--config.seed={seed}",
         f"--config.evals.zeroshot.log_steps={eval_every}", *extra], out / f"seed{seed}.log")
    seconds = time.time() - start
    eval_out = wd / "eval"
    run([py, "scripts/evaluate.py", "--checkpoint", str(wd), "--config", "configs/eval/imagefolder.py",
         "--out", str(eval_out), f"--config.root={data / 'digits'}", "--config.split=val", "--overwrite"],
        out / f"seed{seed}.log")
    records = metrics.read_jsonl(str(wd / metrics.JSONL_NAME))
    curve = [(r["step"], r[k]) for r in records for k in r
             if k.startswith("zeroshot/") and k.count("/") == 2 and k.endswith("/top1_csd")]  # not per class
    losses = [(r["step"], r["loss/ppcl"]) for r in records if "loss/ppcl" in r]
    final = json.loads((eval_out / "results.json").read_text())
    top1 = next(v for k, v in final.items() if k.count("/") == 2 and k.endswith("/top1_csd"))  # in %
    result = dict(seed=seed, top1=top1, curve=curve,
                  first_above_50=next((s for s, v in curve if v >= 50.0), None),
                  ppcl_at_300=next((v for s, v in losses if s >= 300), None), train_seconds=seconds)
    result_file.write_text(json.dumps(result))
    return result


def markdown(results: list[dict], reference: float | None, steps: int) -> str:
    tops = [r["top1"] for r in results]
    half = (max(tops) - min(tops)) / 2
    lines = [f"configs/own_data.py on the UCI digits (1,297 train / 500 held out), {steps} steps; "
             f"zero-shot top-1 {np.mean(tops):.1f}% ± {half:.1f} (mean ± half range)", "",
             "| seed | zero-shot top-1 | first eval >= 50% at step | loss/ppcl at step 300 |",
             "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['seed']} | {r['top1']:.1f}% | {r['first_above_50']} | "
                     f"{r['ppcl_at_300'] if r['ppcl_at_300'] is None else round(r['ppcl_at_300'], 3)} |")
    if reference is not None:
        lines += ["", f"Logistic regression on the pixels, same split (supervised): {reference:.1f}%"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the data, the runs and the results")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--steps", type=int, default=0, help="training steps (default: the config's)")
    parser.add_argument("--eval-every", type=int, default=250, help="zero-shot evaluation interval in steps")
    parser.add_argument("--digits-csv", default="", help="digits.csv.gz (default: scikit-learn's bundled file)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="extra --config.FIELD=VALUE for every training run")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    images, labels = load_digits(digits_csv(args.digits_csv))
    data = write_data(out, images, labels)
    prepare(data)
    steps = args.steps or 5000
    extra = [f"--config.{s}" for s in args.set]
    results = [train_seed(out, data, int(s), steps, args.eval_every, extra) for s in args.seeds.split(",")]
    table = markdown(results, logistic_regression(images, labels), steps)
    (out / "results.md").write_text(table)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
