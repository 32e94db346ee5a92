"""Every evaluator declares a `Config` dataclass parsed by prolip_jax/runtime/schema.py: a misspelled key
is a ValueError naming the nearest field, an ill-typed value is refused, and every key the eval
configs (configs/eval/*.py) and the trainer configs' `evals` sections use is a field."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

import evaluators
from evaluators import prompt_reweighting, zeroshot
from prolip_jax.runtime import config_args, schema
from prolip_jax.trainer.build import EVAL_KEYS  # a run's settings of an evaluator, not its config

ROOT = Path(__file__).resolve().parents[1]


def config_class(kind: str) -> type:
    return sys.modules[evaluators.get(kind).__module__].Config


@pytest.mark.parametrize("kind", sorted(evaluators.REGISTRY))
def test_misspelled_key_names_the_nearest_field(kind):
    cls = evaluators.get(kind)   # the registry's "module:class" imported here, not by `import evaluators`
    assert cls.__module__.startswith("evaluators.") and isinstance(cls, type)
    assert dataclasses.is_dataclass(config_class(kind))
    assert config_class(kind).__dataclass_params__.frozen
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['batchsize'\].*did you mean 'batch_size'"):
        cls(dict(batchsize=8), None)   # the config is parsed before the model or any data is read


@pytest.mark.parametrize("kind", sorted(evaluators.REGISTRY))
def test_ill_typed_value_is_refused(kind):
    with pytest.raises(TypeError, match="batch_size"):
        evaluators.get(kind)(dict(batch_size="many"), None)


def test_choices_and_validate_name_the_field():
    with pytest.raises(ValueError, match=r"dataset='imgfolder' is not one of"):
        evaluators.get("zeroshot")(dict(dataset="imgfolder"), None)
    with pytest.raises(ValueError, match="needs config.root"):
        evaluators.get("zeroshot")(dict(dataset="imagefolder"), None)
    with pytest.raises(ValueError, match=r"same_modality\[0\]='x2y'"):
        evaluators.get("retrieval")(dict(same_modality=("x2y",)), None)
    with pytest.raises(ValueError, match="needs config.data_dir"):
        evaluators.get("datacomp38")(dict(), None)
    with pytest.raises(ValueError, match="unknown prompt selection"):
        evaluators.get("zeroshot")(dict(prompt_select="best:3"), None)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['alfa'\].*did you mean 'alpha'"):
        prompt_reweighting.parse_config(dict(alfa=2.0))


def test_prompt_reweighting_defaults():
    c = zeroshot.BPRWEvaluator.parse(dict(dataset="demo"))
    assert c.bprw == ("nn", "fewshot") and c.bprw_only
    assert zeroshot.BPRWEvaluator.parse(dict(bprw="nn")).bprw == "nn"
    assert zeroshot.Evaluator.parse(dict()).bprw is None and not zeroshot.Evaluator.parse({}).bprw_only


@pytest.mark.parametrize("spec", [
    "configs/eval/coco.py", "configs/eval/cub.py",
    "configs/eval/demo.py:evals=zeroshot+retrieval+uncertainty+hierarcaps",
    "configs/eval/imagefolder.py:evals=zeroshot+retrieval",
    "configs/eval/paper_uncertainty.py:coco_json=a.json,coco_root=r,hcaps_csv=h.csv,hcaps_images=i,"
    "imagenet=n,tokenizer=t",
    "configs/demo.py", "configs/own_data.py:zeroshot=/data/digits", "configs/pcmepp_coco.py",
])
def test_every_eval_config_key_is_a_field(spec):
    evals = config_args.load_config_file(str(ROOT / spec)).evals
    assert evals, spec
    for name, ecfg in evals.items():
        ecfg = ecfg.to_dict() if hasattr(ecfg, "to_dict") else dict(ecfg)
        section = {k: v for k, v in ecfg.items() if k not in EVAL_KEYS}
        try:
            schema.parse(config_class(ecfg["type"]), section, f"config.evals.{name}")
        except ValueError as e:   # a template may leave a data set's path empty: only that
            assert "needs" in str(e) and "unknown" not in str(e), (spec, name, e)


def test_the_trainer_loads_only_the_evaluators_its_config_names():
    """`import prolip_jax.train` (every trainer process) imports no evaluator module and no
    scipy: `evaluators.get` imports the one a config's `evals` names."""
    code = ("import sys, prolip_jax.train; print(sorted(m for m in sys.modules "
            "if m.startswith(('evaluators.', 'scipy'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), check=True).stdout
    assert out.strip() == "[]", out
