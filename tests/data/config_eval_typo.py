"""tests/test_train_cli.py: configs/tiny.py with an evaluator type that does not exist."""
from pathlib import Path

from prolip_jax.runtime import config_args


def get_config(arg=None):
    c = config_args.load_config_file(f"{Path(__file__).parents[2] / 'configs' / 'tiny.py'}:data=random")
    c.evals.zs = dict(type="zeroshoot", dataset="demo")
    return c
