"""Plain single-device oracles shared by the tests."""

import numpy as np


def dense_reference(name, table, acc, rows, grads, lr, eps=1e-8):
    """One textbook optimizer step on the full-table gradient built from (rows, grads)."""
    R = table.shape[0]
    g = np.zeros_like(table, dtype=np.float64)
    for r, gr in zip(rows, grads, strict=True):
        if 0 <= r < R:
            g[r] += gr
    if name == "sgd":
        return table - lr * g, acc
    if name == "adagrad":
        acc = acc + g * g
        return table - lr * g / (np.sqrt(acc) + eps), acc
    acc = acc + (g * g).mean(-1)
    return table - lr * g / (np.sqrt(acc)[:, None] + eps), acc
