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
    if name == "ftrl":  # acc = (z, n); only looked-up rows change (the weights of the others
        z, n = acc  # need not follow from their (z, n): a table may start anywhere)
        touched = np.zeros(R, bool)
        touched[[r for r in rows if 0 <= r < R]] = True
        n_new = n + g * g
        z_new = z + g - (np.sqrt(n_new) - np.sqrt(n)) / lr * table
        w = np.where(np.abs(z_new) > 0, -z_new / (np.sqrt(n_new) / lr), 0.0)
        keep = ~touched[:, None]
        return np.where(keep, table, w), (np.where(keep, z, z_new), np.where(keep, n, n_new))
    if name == "adagrad":
        acc = acc + g * g
        return table - lr * g / (np.sqrt(acc) + eps), acc
    acc = acc + (g * g).mean(-1)
    return table - lr * g / (np.sqrt(acc)[:, None] + eps), acc
