r"""COCO Caption benchmarks on the Karpathy 5K test split, all in one retrieval evaluator:
COCO 5K and 1K (5 folds) R@1/5/10, RSUM, R-Precision, mAP@R; ECCV Caption and CxC; PMRP;
ASP (TF-IDF); recall per uncertainty bin with rho (probabilistic models).

    python scripts/evaluate.py --checkpoint CKPT --out DIR --config configs/eval/coco.py \
        --config.karpathy_json=/data/coco/dataset_coco.json --config.image_root=/data/coco \
        --config.instances=/data/coco/annotations/instances_val2014.json \
        --config.coco_annotations=/data/coco/annotations/captions_val2014.json

Fields (`--config.<field>=value`):
    karpathy_json     dataset_coco.json (Karpathy split file)
    image_root        folder holding <filepath>/<filename> (val2014/COCO_val2014_*.jpg)
    split             "test" (5,000 images; "val" for the validation split)
    instances         instances_val2014.json (comma-separate several) -> PMRP, zeta 0/1/2
                      (PCME / Pishdad et al. §4.3); "" -> PMRP skipped with one warning
    pmrp_unannotated  "drop" (PCME's evaluate_pmrp_coco.py: images without an instance are no
                      query and no gallery item) | "zero" (kept with an all-zero vector)
    coco_annotations  captions_val2014.json (comma-separate several): the COCO caption ids
                      that ECCV Caption / CxC need (eccv_caption installed); "" -> those skipped
    asp               True: ASP with DAA's TF-IDF semantic score (DAA §4.1; named
                      asp_tfidf: CIDEr-D would give other values)
    scores            ("csd",): -CSD (mu alone for a deterministic model); add "dot" for mu.mu
    unc_bins          10 (0: off): R@1 / mAP@R per query-uncertainty bin, corr and rho
    tokenizer.kind / tokenizer.path   "" path: the tokenizer recorded with the checkpoint
    batch_size        images per batch (256)

Metric names: retrieval/coco/<score>/{5k,1k}/{i2t,t2i}_R@{1,5,10}, rsum, {i2t,t2i}_rprecision,
{i2t,t2i}_map_at_r, {i2t,t2i}_pmrp[_zeta{0,1,2}], {i2t,t2i}_asp_tfidf,
{i2t,t2i}/unc_bin{i}_R1, {i2t,t2i}/unc_rho_R1; retrieval/coco/<score>/eccv/{i2t,t2i,mean}_
{r1,map_at_r,rprecision}; retrieval/coco/<score>/cxc/{i2t,t2i}_R@{1,5,10}
(evaluators/retrieval.py, evaluators/caption_metrics.py). Written to DIR/results.json and
DIR/results.md. Cost on 2 CPU cores after encoding, PMRP + ASP on 5K and 1K: about 2 minutes
per score kind (synthetic 5,000 x 25,000 embeddings; peak ~1 GB).
"""
import ml_collections as mlc


def get_config(arg=None):
    del arg
    c = mlc.ConfigDict()
    c.karpathy_json = ""
    c.image_root = ""
    c.split = "test"
    c.instances = ""
    c.pmrp_unannotated = "drop"
    c.coco_annotations = ""
    c.asp = True
    c.scores = ("csd",)
    c.unc_bins = 10
    c.batch_size = 256
    c.tokenizer = mlc.ConfigDict(dict(kind="sentencepiece", path=""))
    c.evals = mlc.ConfigDict()
    c.evals.coco = mlc.ConfigDict(dict(
        type="retrieval", dataset="karpathy", name="coco",
        karpathy_json=c.get_ref("karpathy_json"), image_root=c.get_ref("image_root"),
        split=c.get_ref("split"), captions_per_image=5, num_folds=5, fold_size=1000,
        instances=c.get_ref("instances"), pmrp_unannotated=c.get_ref("pmrp_unannotated"),
        pmrp_zetas=(0, 1, 2), coco_annotations=c.get_ref("coco_annotations"),
        asp=c.get_ref("asp"), asp_captions_per_image=5, eccv=True,
        scores=c.get_ref("scores"), unc_bins=c.get_ref("unc_bins"),
        batch_size=c.get_ref("batch_size"), same_modality=()))
    c.evals.coco.tokenizer = c.tokenizer
    return c
