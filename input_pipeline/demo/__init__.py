"""Built-in demo dataset: procedural shapes with hierarchical captions (see dataset.py)."""
from input_pipeline.demo.dataset import (DemoConfig, DemoDataset, DemoTokenizer, SPLITS,
                                         default_cache_dir, get_demo, object_classnames)
from input_pipeline.demo.render import (COLOUR_NAMES, LEVEL_NAMES, POSITION_NAMES, SHAPES,
                                        SIZE_NAMES, Factors)

__all__ = ["DemoConfig", "DemoDataset", "DemoTokenizer", "SPLITS", "default_cache_dir",
           "get_demo", "object_classnames", "COLOUR_NAMES", "LEVEL_NAMES", "POSITION_NAMES",
           "SHAPES", "SIZE_NAMES", "Factors"]
