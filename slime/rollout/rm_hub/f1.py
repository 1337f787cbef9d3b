"""Token-level F1 between a predicted and a gold answer (SQuAD/HotpotQA normalisation), used by search-style QA tasks."""

import re
import string
from collections import Counter

_PUNCTUATION = set(string.punctuation)
_ZERO_METRIC = (0, 0, 0)


def normalize_answer(s: str) -> str:
    """Lowercase, drop punctuation, replace the articles a/an/the by spaces, collapse whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(prediction, ground_truth) -> tuple:
    """(f1, precision, recall); yes/no/noanswer must match exactly, otherwise all three are 0."""
    if prediction is None:
        return _ZERO_METRIC
    normalized_prediction = normalize_answer(prediction)
    normalized_ground_truth = normalize_answer(str(ground_truth))

    special = ("yes", "no", "noanswer")
    if (normalized_prediction in special or normalized_ground_truth in special) and (
        normalized_prediction != normalized_ground_truth
    ):
        return _ZERO_METRIC

    prediction_tokens = normalized_prediction.split()
    ground_truth_tokens = normalized_ground_truth.split()
    num_same = sum((Counter(prediction_tokens) & Counter(ground_truth_tokens)).values())
    if num_same == 0:
        return _ZERO_METRIC
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall), precision, recall
