"""Labels and scores from a classifier's logits, as every classifier answers them (efficientnet and
the classification folders of classifier.py): the top_k labels, best first."""

from __future__ import annotations

import numpy as np


def top_labels(logits: np.ndarray, labels: list[str], top_k: int, multi_label: bool = False) -> list[dict[str, object]]:
    """The `top_k` best of `logits` (float32[len(labels)]) as [{"label", "index", "probability"}],
    best first (ties: the lower index first). Probabilities are a softmax over the logits, or with
    `multi_label` a sigmoid per label (transformers' problem_type multi_label_classification)."""
    if multi_label:
        probabilities = 1.0 / (1.0 + np.exp(-logits))
    else:
        shifted = np.exp(logits - logits.max())
        probabilities = shifted / shifted.sum()
    best = np.argsort(-probabilities, kind="stable")[:top_k]
    return [{"label": labels[k], "index": int(k), "probability": float(probabilities[k])} for k in best]
