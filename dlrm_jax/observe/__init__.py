"""Observability: exact eval metrics and the metrics.jsonl / TensorBoard writer (``metrics``),
reading compiled programs and traces into per-phase times (``trace``), and the report's
figures (``report``). ``dlrm-jax profile``'s driver, which runs steps, is in ``bench.profile``."""
