r"""CUB Captions (PCME's protocol; DAA seed 004 §5.1.1): retrieval on the 50 test classes with
class-level positives (every image-caption pair of the same class), R-Precision as the main
metric, plus R@K and mAP@R under the same positives, and recall per uncertainty bin with rho.

    python scripts/evaluate.py --checkpoint CKPT --out DIR --config configs/eval/cub.py \
        --config.image_root=/data/CUB_200_2011/images --config.caption_root=/data/cub/text_c10 \
        --config.classes=/data/cub/testclasses.txt

Fields (`--config.<field>=value`):
    image_root     CUB_200_2011/images (<class folder>/<name>.jpg)
    caption_root   text_c10 of Reed et al. 2016 (<class folder>/<name>.txt, 10 captions)
    classes        the test class list (Xian et al.'s testclasses.txt, one class folder a line)
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
    c.image_root = ""
    c.caption_root = ""
    c.classes = ""
    c.asp = False
    c.scores = ("csd",)
    c.unc_bins = 10
    c.batch_size = 256
    c.tokenizer = mlc.ConfigDict(dict(kind="sentencepiece", path=""))
    c.evals = mlc.ConfigDict()
    c.evals.cub = mlc.ConfigDict(dict(
        type="retrieval", dataset="cub", image_root=c.get_ref("image_root"),
        caption_root=c.get_ref("caption_root"), classes=c.get_ref("classes"),
        positives="class", num_folds=0, asp=c.get_ref("asp"), asp_captions_per_image=10,
        scores=c.get_ref("scores"), unc_bins=c.get_ref("unc_bins"),
        batch_size=c.get_ref("batch_size"), same_modality=()))
    c.evals.cub.tokenizer = c.tokenizer
    return c
