"""The runtime plumbing every layer may use: the path layer for local and bucket paths
(paths.py), typed config sections (schema.py, config_args.py), short errors (messages.py),
metrics and the console (metrics.py, window.py, overview.py), the profiler, library logging
into the workdir, and the processes of a multi-process run (supervise.py, peers.py,
train_flags.py). It imports nothing else of the project (tests/test_layers.py).
"""
