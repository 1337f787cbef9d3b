"""DeepScaleR rule reward: grade the last `\\boxed{}` of the solution part of a reasoning response."""

from .math_utils import extract_answer, grade_answer_mathd, grade_answer_sympy


def get_deepscaler_rule_based_reward(response: str, label) -> int:
    """1 if the boxed answer after the last `</think>` (else after the first `###Response`) matches `label`, else 0."""
    if "</think>" in response:
        model_solution = response.split("</think>")[-1]
    elif "###Response" in response:
        model_solution = response.split("###Response")[1]  # up to a second ###Response, as the reference
    else:
        return 0  # no finished reasoning: no reward

    model_answer = extract_answer(model_solution)
    if model_answer is None:
        return 0
    if label == "":
        return 0
    if not isinstance(label, (str, float, int)):
        raise TypeError(
            f"deepscaler reward: the label must be a str, int or float answer, got {type(label).__name__} {label!r}; "
            "check the --label-key column of your prompt data."
        )
    ground_truth = str(label)
    if "\\boxed" in ground_truth:
        ground_truth = extract_answer(ground_truth)
        if ground_truth is None:
            return 0
    return 1 if grade_answer_mathd(model_answer, ground_truth) or grade_answer_sympy(model_answer, ground_truth) else 0
