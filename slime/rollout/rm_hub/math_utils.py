"""Math answer grading (Hendrycks MATH normalisation + deepscaler/verl sympy equivalence).

Every step here decides a reward, so the rules follow the reference graders (slime's / verl's) exactly; do not "improve" them
without knowing that it silently changes training signals.
"""

import re
from typing import Optional

import sympy
from pylatexenc import latex2text
from sympy.parsing import sympy_parser

from .math_dapo_utils import braced_from

# ---------------------------------------------------------------------------------------------------------------------
# Boxed-answer extraction
# ---------------------------------------------------------------------------------------------------------------------


def last_boxed_only_string(string: str) -> Optional[str]:
    """The last `\\boxed{...}` (or, failing that, the last `\\fbox{...}`) with its braces matched; None if absent/unterminated."""
    idx = string.rfind("\\boxed")
    if idx < 0:
        idx = string.rfind("\\fbox")
        if idx < 0:
            return None
    return braced_from(string, idx)


def remove_boxed(s: Optional[str]) -> Optional[str]:
    """Inner text of a whole-string `\\boxed{...}`; None for anything else (never raises)."""
    left = "\\boxed{"
    if isinstance(s, str) and s.startswith(left) and s.endswith("}"):
        return s[len(left) : -1]
    return None


def extract_boxed_answer(solution: str) -> Optional[str]:
    return remove_boxed(last_boxed_only_string(solution))


def extract_answer(passage: str) -> Optional[str]:
    if "\\boxed" in passage:
        return extract_boxed_answer(passage)
    return None


# ---------------------------------------------------------------------------------------------------------------------
# Hendrycks MATH string normalisation (grade_answer_mathd)
# ---------------------------------------------------------------------------------------------------------------------


def _fix_fracs(string: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{72}` -> `\\frac{1}{72}`; one char after `\\frac` leaves the input as is.

    A bare trailing `\\frac` raises IndexError, which mathd_normalize_answer turns into "keep the raw answer" (as the reference).
    """
    substrs = string.split("\\frac")
    new_str = substrs[0]
    for substr in substrs[1:]:
        new_str += "\\frac"
        if substr[0] == "{":
            new_str += substr
            continue
        if len(substr) < 2:
            return string
        a, b, rest = substr[0], substr[1], substr[2:]
        if b != "{":
            new_str += "{" + a + "}{" + b + "}" + rest
        else:
            new_str += "{" + a + "}" + b + rest
    return new_str


def _fix_a_slash_b(string: str) -> str:
    """`3/4` -> `\\frac{3}{4}`, only for two plain integers written canonically."""
    parts = string.split("/")
    if len(parts) != 2:
        return string
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return string
    if string != f"{a}/{b}":
        return string
    return "\\frac{" + str(a) + "}{" + str(b) + "}"


def _remove_right_units(string: str) -> str:
    # In MATH, "\text{ " (with the space) only ever introduces units on the right.
    if "\\text{ " in string:
        splits = string.split("\\text{ ")
        if len(splits) != 2:
            raise ValueError("several \\text{ } unit blocks")  # mathd_normalize_answer falls back to the raw answer
        return splits[0]
    return string


def _fix_sqrt(string: str) -> str:
    """`\\sqrt3` -> `\\sqrt{3}`."""
    if "\\sqrt" not in string:
        return string
    splits = string.split("\\sqrt")
    new_string = splits[0]
    for split in splits[1:]:
        if (
            split[0] != "{"
        ):  # IndexError on a trailing "\sqrt" is caught by mathd_normalize_answer, as in the reference
            new_string += "\\sqrt{" + split[0] + "}" + split[1:]
        else:
            new_string += "\\sqrt" + split
    return new_string


def _strip_string(string: str) -> str:
    # 1. line breaks, inverse spaces, double backslashes, frac variants, \left \right
    string = string.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    string = string.replace("tfrac", "frac").replace("dfrac", "frac")
    string = string.replace("\\left", "").replace("\\right", "")
    # 2. degrees and dollar signs
    string = string.replace("^{\\circ}", "").replace("^\\circ", "")
    string = string.replace("\\$", "")
    # 3. units on the right
    string = _remove_right_units(string)
    # 4. percent
    string = string.replace("\\%", "")
    # 5. " ." == " 0." and "{." == "{0."; a leading "." gets a 0
    string = string.replace(" .", " 0.").replace("{.", "{0.")
    if len(string) == 0:
        return string
    if string[0] == ".":
        string = "0" + string
    # 6. drop a short "k = " / "x=" prefix
    if len(string.split("=")) == 2 and len(string.split("=")[0]) <= 2:
        string = string.split("=")[1]
    # 7. \sqrt3 -> \sqrt{3}, then remove spaces
    string = _fix_sqrt(string)
    string = string.replace(" ", "")
    # 8. \frac12 -> \frac{1}{2}
    string = _fix_fracs(string)
    # 9. the dataset writes 1/2 as \frac{1}{2}
    if string == "0.5":
        string = "\\frac{1}{2}"
    # 10. a/b -> \frac{a}{b}
    return _fix_a_slash_b(string)


def mathd_normalize_answer(answer: Optional[str]) -> Optional[str]:
    if answer is None:
        return None
    answer = answer.strip()
    try:
        m = re.search(r"^\\text\{(?P<text>.+?)\}$", answer)
        if m is not None:
            answer = m.group("text").strip()
        return _strip_string(answer)
    except Exception:
        return answer


def grade_answer_mathd(given_answer: str, ground_truth: str) -> bool:
    return mathd_normalize_answer(ground_truth) == mathd_normalize_answer(given_answer)


# ---------------------------------------------------------------------------------------------------------------------
# sympy-based equivalence (grade_answer_sympy)
# ---------------------------------------------------------------------------------------------------------------------

# sympy can hang on huge powers; refuse those rather than being lenient.
BAD_SUBSTRINGS = ["^{", "^("]
BAD_REGEXES = [r"\^[0-9]+\^", r"\^[0-9][0-9]+"]
TUPLE_CHARS = "()[]"
_UNITS = [
    "degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour",
    "day", "week", "month", "year", "foot", "feet", "inch", "yard",
]  # fmt: skip
# parse_expr evaluates Python: give it sympy's names only, never builtins.
_SYMPY_GLOBALS: dict = {}
exec("from sympy import *", _SYMPY_GLOBALS)
_SYMPY_GLOBALS["__builtins__"] = {}


def _sympy_parse(expr: str):
    py_expr = expr.replace("^", "**")
    return sympy_parser.parse_expr(
        py_expr,
        global_dict=_SYMPY_GLOBALS,
        transformations=sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,),
    )


def _parse_latex(expr: str) -> str:
    """LaTeX -> plain text sympy can read."""
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    expr = expr.replace("\\frac", " \\frac")  # keeps mixed numbers "1\frac{1}{2}" apart
    expr = latex2text.LatexNodes2Text().latex_to_text(expr)
    for old, new in (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*")):
        expr = expr.replace(old, new)
    return expr.strip()


def _is_float(num: str) -> bool:
    try:
        float(num)
        return True
    except ValueError:
        return False


def _is_int(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except (OverflowError, ValueError):
        return False


def _is_frac(expr: str) -> bool:
    return bool(re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr))


def _str_is_int(x: str) -> bool:
    try:
        return _is_int(float(_strip_properly_formatted_commas(x)))
    except ValueError:
        return False


def _str_to_int(x: str) -> int:
    return int(float(x.replace(",", "")))


def _inject_implicit_mixed_number(step: str) -> str:
    """`7 3/4` -> `7+3/4`."""
    return re.sub(r"([0-9]) +([0-9])", r"\1+\2", step)


def _strip_properly_formatted_commas(expr: str) -> str:
    # Only thousands separators: "1,000,000" -> "1000000" but "(1,2)" keeps its tuple comma.
    pattern = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
    while True:
        next_expr = pattern.sub(r"\1\3\4", expr)
        if next_expr == expr:
            return next_expr
        expr = next_expr


def _normalize(expr: Optional[str]) -> Optional[str]:
    if expr is None:
        return None
    m = re.search(r"^\\text\{(?P<text>.+?)\}$", expr)
    if m is not None:
        expr = m.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    expr = expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    for unit in _UNITS:
        expr = re.sub(f"{unit}(es)?(s)? *(\\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if len(expr) > 0 and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    if _is_float(expr) and _is_int(float(expr)):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        try:
            expr = _parse_latex(expr)
        except Exception:
            pass
    expr = re.sub("- *", "-", expr)  # "- 3" -> "-3" before mixed-number injection
    expr = _inject_implicit_mixed_number(expr)
    expr = expr.replace(" ", "").replace("{", "").replace("}", "")
    expr = expr.lower()
    if _str_is_int(expr):
        expr = str(_str_to_int(expr))
    return expr


def count_unknown_letters_in_expr(expr: str) -> int:
    expr = expr.replace("sqrt", "").replace("frac", "")
    return len({x for x in expr if x.isalpha()})


def should_allow_eval(expr: str) -> bool:
    if count_unknown_letters_in_expr(expr) > 2:
        return False
    if any(bad in expr for bad in BAD_SUBSTRINGS):
        return False
    return not any(re.search(bad, expr) is not None for bad in BAD_REGEXES)


def are_equal_under_sympy(ground_truth_normalized: str, given_normalized: str) -> bool:
    try:
        expr = f"({ground_truth_normalized})-({given_normalized})"
        if should_allow_eval(expr):
            return sympy.simplify(_sympy_parse(expr)) == 0
    except Exception:  # any parse/simplify failure means "not shown equal"
        pass
    return False


def split_tuple(expr: str) -> list[str]:
    """Elements of a tuple/interval like `(1,2]`; a plain expression is a single element."""
    expr = _strip_properly_formatted_commas(expr)
    if len(expr) == 0:
        return []
    if (
        len(expr) > 2
        and expr[0] in TUPLE_CHARS
        and expr[-1] in TUPLE_CHARS
        and all(ch not in expr[1:-1] for ch in TUPLE_CHARS)
    ):
        return [elem.strip() for elem in expr[1:-1].split(",")]
    return [expr]


def grade_answer_sympy(given_answer: str, ground_truth: str) -> bool:
    ground_truth_normalized = _normalize(ground_truth)
    given_normalized = _normalize(given_answer)
    if ground_truth_normalized is None:
        return False
    if ground_truth_normalized == given_normalized:
        return True
    if len(given_normalized) == 0:
        return False

    ground_truth_elems = split_tuple(ground_truth_normalized)
    given_elems = split_tuple(given_normalized)
    if len(ground_truth_elems) > 1 and (
        ground_truth_normalized[0] != given_normalized[0] or ground_truth_normalized[-1] != given_normalized[-1]
    ):
        return False  # (a,b) vs [a,b]: open and closed intervals differ
    if len(ground_truth_elems) != len(given_elems):
        return False
    for gt_elem, given_elem in zip(ground_truth_elems, given_elems):
        if _is_frac(gt_elem) and _is_frac(given_elem):
            is_correct = gt_elem == given_elem  # an unreduced fraction is wrong, so no simplify here
        elif _str_is_int(gt_elem) != _str_is_int(given_elem):
            is_correct = False  # an integer answer must match an integer exactly
        else:
            is_correct = are_equal_under_sympy(gt_elem, given_elem)
        if not is_correct:
            return False
    return True


def grade_answer_verl(solution_str: str, ground_truth) -> bool:
    """True iff the last `\\boxed{}` of `solution_str` matches `ground_truth` (itself possibly boxed)."""
    ground_truth = "" if ground_truth is None else str(ground_truth)  # int/float labels are graded by their text
    if not ground_truth:
        return False
    if "\\boxed" in ground_truth:
        ground_truth = extract_answer(ground_truth)
    given_answer = extract_answer(solution_str)
    if given_answer is None:
        return False
    return grade_answer_mathd(given_answer, ground_truth) or grade_answer_sympy(given_answer, ground_truth)
