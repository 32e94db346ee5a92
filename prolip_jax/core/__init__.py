"""The core: the towers (models/), the objectives and their distances (objectives/), the weight
importers (pretrained/), the train step, the optimiser, sharding, checkpoints, match targets,
initialisation, image normalisation, FLOP counts and encoding. It imports the runtime below it,
never the input pipeline, the evaluators or the trainer above it (tests/test_layers.py).
"""
