"""Exact-match reward for retrieval QA (Search-R1's qa_em): normalised string equality of the last <answer>."""

import re
import string


def normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def em_check(prediction: str, golden_answers) -> int:
    if isinstance(golden_answers, str):
        golden_answers = [golden_answers]
    pred = normalize_answer(prediction)
    return int(any(normalize_answer(g) == pred for g in golden_answers))


def extract_solution(response: str):
    """The last <answer>...</answer> the model wrote, or None.

    Search-R1 searched prompt + response and skipped the instruction's example tags by requiring two matches; its
    instruction actually holds two (`<answer> and </answer>`, `<answer> Beijing </answer>`), so a response without an
    answer was graded as answering "Beijing". Reading the response alone has no such dependence on the prompt.
    """
    matches = list(re.finditer(r"<answer>(.*?)</answer>", response, re.DOTALL))
    return matches[-1].group(1).strip() if matches else None


def compute_score_em(response: str, ground_truth: dict, format_score: float = 0.0, score: float = 1.0) -> float:
    """`score` for a correct answer, `format_score` for a wrong but well-formed one, 0 without an answer."""
    answer = extract_solution(response)
    if answer is None:
        return 0.0
    return score if em_check(answer, ground_truth["target"]) else format_score
