"""tfds data sources (optional extra `tfds`; skipped without tensorflow-datasets)."""
import numpy as np
import pytest

tfds = pytest.importorskip("tensorflow_datasets")

from input_pipeline import pipeline
from conftest import KeyTokenizer


class PipelineTestCaptions(tfds.core.GeneratorBasedBuilder):
    """COCO-captions-like: a decoded image, several captions, a label (no TF needed)."""
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
            "image": tfds.features.Tensor(shape=(None, None, 3), dtype=np.uint8,
                                          encoding="zlib"),
            "captions": tfds.features.FeaturesDict(
                {"text": tfds.features.Sequence(tfds.features.Text())}),
            "label": tfds.features.Tensor(shape=(), dtype=np.int64)}))

    def _split_generators(self, dl_manager):
        del dl_manager
        return {"train": self._generate_examples(24)}

    def _generate_examples(self, n):
        for i in range(n):
            yield i, {"image": np.full((20, 30, 3), 10 * i, np.uint8),
                      "captions": {"text": [f"{i} first", f"{i} second", ""][: 2 + (i == 5)]},
                      "label": i % 3}


def test_tfds_source(tmp_path):
    PipelineTestCaptions(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    cfg = dict(source="tfds", tfds_name="pipeline_test_captions", tfds_split="train",
               tfds_data_dir=str(tmp_path), text_key="captions/text", label_key="label",
               batch_size=8, image_size=16, image_dtype="uint8")
    ev = pipeline.build_eval_iterator(cfg, KeyTokenizer(), process_index=0, process_count=1)
    seen = {}
    for b in ev:
        for key, image, label in zip(b["text"][b["mask"], 0], b["image"][b["mask"]],
                                     b["label"][b["mask"]]):
            seen[int(key)] = (int(image.mean()), int(label))
    # Eval takes the first caption of each record (record 5 also has an empty one).
    assert seen == {k: (10 * k, k % 3) for k in range(24)}
    tr = pipeline.build_train_iterator(cfg, KeyTokenizer(), process_index=1, process_count=2)
    batch = next(tr)
    assert batch["image"].shape == (4, 16, 16, 3) and batch["label"].shape == (4,)
