r"""CUB Captions (PCME's protocol; DAA §5.1.1): retrieval on the 50 test classes with
class-level positives (every image-caption pair of the same class), R-Precision as the main
metric, plus R@K and mAP@R under the same positives, and recall per uncertainty bin with rho.

    python scripts/evaluate.py --checkpoint CKPT --out DIR --config configs/eval/cub.py \
        --config.root=/data/cub --config.split=test

Fields (`--config.<field>=value`):
    root           images/<class folder>/<name>.jpg (CUB_200_2011/images) and text_c10/<class
                   folder>/<name>.txt (Reed et al. 2016, 10 captions): the layout the training
                   source data.source='cub' reads (input_pipeline/captions.py)
    split          "test": the classes of <split_dir or root>/testclasses.txt (Xian et al.)
    split_dir      where <split>classes.txt is; "" = root
    asp            False; True: ASP (TF-IDF) with P = asp_captions_per_image (10 here)
    scores         ("csd",); unc_bins 10; batch_size 256
    tokenizer.kind / tokenizer.path   "" path: the tokenizer recorded with the checkpoint

Metric names: retrieval/cub/<score>/{i2t,t2i}_rprecision (R-P), {i2t,t2i}_R@{1,5,10}, rsum,
{i2t,t2i}_map_at_r, {i2t,t2i}/unc_bin{i}_R1, {i2t,t2i}/unc_rho_R1 (DIR/results.json, results.md).
"""
import ml_collections as mlc


def get_config(arg=None):
    del arg
    c = mlc.ConfigDict()
    c.root = ""
    c.split = "test"
    c.split_dir = ""
    c.asp = False
    c.scores = ("csd",)
    c.unc_bins = 10
    c.batch_size = 256
    c.tokenizer = mlc.ConfigDict(dict(kind="sentencepiece", path=""))
    c.evals = mlc.ConfigDict()
    c.evals.cub = mlc.ConfigDict(dict(
        type="retrieval", dataset="cub", root=c.get_ref("root"), split=c.get_ref("split"),
        split_dir=c.get_ref("split_dir"),
        positives="class", num_folds=0, asp=c.get_ref("asp"), asp_captions_per_image=10,
        scores=c.get_ref("scores"), unc_bins=c.get_ref("unc_bins"),
        batch_size=c.get_ref("batch_size"), same_modality=()))
    c.evals.cub.tokenizer = c.tokenizer
    return c
