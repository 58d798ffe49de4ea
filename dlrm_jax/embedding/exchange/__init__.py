"""The sparse exchange inside the jitted step: ids routed to their owners (``routing``), the
all-to-all forms (``sharded``, ``pooled``, ``replicated``, with what they share in
``common``), the sparse optimizers applied on the owners (``optimizers``, ``sums``), the hot rows replicated
on every device (``hot_rows``), table
initialisation and relayout, and :class:`~dlrm_jax.embedding.exchange.collection.EmbeddingCollection`,
the one object a train step calls."""
