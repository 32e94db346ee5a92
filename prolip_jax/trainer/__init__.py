"""The trainer as parts, read in this order:

- config.py: the typed config (`parse_config`, `with_defaults`, what a checkpoint records);
- build.py: config to parts (mesh, model, step settings, optimiser, data, evaluators), checked;
- state.py: the state a run starts from (fresh, warm, restored) and `Run`, what the loop shares;
- checkpoints.py: saves, and how a fault stops a run (save what is sound, then one line);
- hooks.py: what happens around each step, a hook each;
- loop.py: `train(config, workdir)` and the loop over steps.

prolip_jax/train.py is the command line around them.
"""
