"""Benchmarks behind ``dlrm-jax bench``: each compares variants side by side in one run, prints
a table and writes JSON (``common`` holds what they share).

train        train-step samples/s of several configs
embedding    the embedding step of every sharding strategy against XLA baselines
exchange     the compiled train step's exchange bytes against the plan and the lower bound
collectives  all-to-all against all-reduce bandwidth on the current mesh
hot          hot-row replication against none, on skewed and frequency-ordered ids
mlp_parallel the dense layers data- vs tensor- vs pipeline-parallel over model groups
"""
