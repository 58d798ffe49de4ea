"""Preprocessing: raw Criteo TSV days and tabular CSV / JSON-lines files turned into the sharded
binary layout (:mod:`dlrm_jax.data.shards`) that :mod:`dlrm_jax.data.sources.binary` reads, with
their vocabularies, multi-hot expansion and held-out split (``dlrm-jax preprocess``)."""
