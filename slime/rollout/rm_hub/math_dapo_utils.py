"""DAPO math reward (verl's `math_dapo`): Minerva-style "Answer: ..." extraction, or a strict `\\boxed{}` check.

`compute_score` returns a dict `{"score": 1.0|-1.0, "acc": bool, "pred": str}`; train with `--reward-key score`.
"""

import re
from decimal import Decimal, InvalidOperation
from typing import Optional


def last_boxed_only_string(string: str) -> Optional[str]:
    """The last `\\boxed{...}` with braces matched (this variant ignores `\\fbox` and bare `\\boxed`); None if absent."""
    idx = string.rfind("\\boxed{")
    return None if idx < 0 else braced_from(string, idx)


def braced_from(string: str, idx: int) -> Optional[str]:
    """`string` from `idx` through the brace that closes the first `{` after it; None if it never closes."""
    depth = 0
    for i in range(idx, len(string)):
        if string[i] == "{":
            depth += 1
        elif string[i] == "}":
            depth -= 1
            if depth == 0:
                return string[idx : i + 1]
    return None


def remove_boxed(s: str) -> str:
    left = "\\boxed{"
    assert s[: len(left)] == left, f"box error: {s}"
    assert s[-1] == "}", f"box error: {s}"
    return s[len(left) : -1]


SUBSTITUTIONS = [
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
]

# "\\text{\ns}" and "\\text{\n}" contain a real newline, exactly as in the Minerva/verl lists.
REMOVED_EXPRESSIONS = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
    # [HEAD] chat end markers that may survive detokenisation
    "<|im_end|>", "<|endoftext|>",
]  # fmt: skip


def normalize_final_answer(final_answer) -> str:
    """Normalise a final answer to a quantitative question (Lewkowycz et al. 2022, appendix D)."""
    final_answer = str(final_answer).split("=")[-1]
    for before, after in SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        final_answer = final_answer.replace(expr, "")

    # Keep the math inside $...$ and unwrap text-like macros.
    final_answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", final_answer)
    final_answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", final_answer)

    # Shorthand TeX: \fracab -> \frac{a}{b}, \fracabc -> \frac{a}{b}c, \sqrta -> \sqrt{a}.
    final_answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", final_answer)
    final_answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", final_answer)
    final_answer = final_answer.replace("$", "")

    # "1,000" -> "1000" (only when nothing but digits and commas)
    if final_answer.replace(",", "").isdigit():
        final_answer = final_answer.replace(",", "")
    return final_answer.strip()


def is_correct_minerva(
    solution_str: str, gt, gt_need_extract: bool = False, answer_pattern: str = r"(?i)Answer\s*:\s*([^\n]+)"
) -> tuple[bool, str]:
    """Compare the last "Answer: X" line with the ground truth after `normalize_final_answer` on both."""
    match = re.findall(answer_pattern, solution_str)
    extracted_answer = match[-1] if match else "[INVALID]"
    pred = normalize_final_answer(extracted_answer)
    if gt_need_extract:
        gt = normalize_final_answer(remove_boxed(last_boxed_only_string(gt)))
    else:
        gt = normalize_final_answer(gt)
    return pred == _whole_number(gt), pred


def _whole_number(gt: str) -> str:
    """DAPO's answers are integers: a label written "5.0", "07" or "1e3" is compared as "5", "7", "1000" (as current
    slime does); any other label, as written (where current slime stops, or truncates "42.5" to 42)."""
    try:
        d = Decimal(gt)
    except InvalidOperation:
        return gt
    return str(int(d)) if d.is_finite() and d.adjusted() < 100 and d == d.to_integral_value() else gt


def is_correct_strict_box(pred: str, gt, pause_tokens_index: Optional[list[int]] = None) -> tuple[int, Optional[str]]:
    """(1 or -1, boxed answer) looking only at the last 100 characters (or 100 before the last pause token)."""
    if pause_tokens_index is not None:
        assert len(pause_tokens_index) == 4, f"pause_tokens_index must have 4 entries, got {pause_tokens_index}"
        pred = pred[pause_tokens_index[-1] - 100 :]
    else:
        pred = pred[-100:]
    boxed_pred = last_boxed_only_string(pred)
    extracted_pred = remove_boxed(boxed_pred) if boxed_pred is not None else None
    return (1 if extracted_pred == gt else -1), extracted_pred


def verify(solution_str: str, answer, strict_box_verify: bool = False, pause_tokens_index: Optional[list[int]] = None):
    """(correct, pred)."""
    if strict_box_verify:
        correct, pred = is_correct_strict_box(solution_str, answer, pause_tokens_index)
        return correct == 1, pred
    return is_correct_minerva(solution_str, answer)


def compute_score(
    solution_str: str, ground_truth, strict_box_verify: bool = False, pause_tokens_index: Optional[list[int]] = None
) -> dict:
    solution_str = solution_str[-300:]  # the longest MATH-500 answer has 159 characters
    correct, pred = verify(solution_str, ground_truth, strict_box_verify, pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
