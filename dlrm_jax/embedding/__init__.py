"""Sharded embedding tables, by idea:

- ``plan/``: tables as specs, the planner that shards them (table-, row-, column-wise or
  replicated), the plan it prints, and the fused arrays a plan implies.
- ``exchange/``: the step's sparse exchange (routing ids to owners, the all-to-all forms, the
  sparse optimizers on the owners) and :class:`EmbeddingCollection`, which puts them together.
- ``hot/``: hot rows replicated on every device, decided on the host: lookup counts, the
  cost model that chooses them, and their refresh during a run (the replicated rows inside
  the step are ``exchange/hot_rows``).

Each folder imports only the ones above it in this list (``tests/test_layers.py``).
- ``tiers/``: tables larger than device memory: the disk tier, DRAM caches, the host-side
  cache planner, and the device-cache fills inside the step.
"""
