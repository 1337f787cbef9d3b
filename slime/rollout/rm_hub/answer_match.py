"""slime-clone specific rule reward `--rm-type answer_match` for plain-number answers (e.g. the tiny addition demo).

Reward 1.0 if the whole response (surrounding whitespace stripped) is an integer equal to the label's integer, else 0.0.
Unlike `math`, no `\\boxed{}` is needed, so a tiny model answering "7" is graded correctly; trailing text earns nothing,
so RL cannot drift toward long answers that merely start with the right number.
"""

import re

_LEADING_INT = re.compile(r"\s*(-?\d+)")
# Chat special tokens (<|im_end|>, <|endoftext|>) are in the text when --rollout-skip-special-tokens is off.
_WHOLE_INT = re.compile(r"\s*(-?\d+)\s*(?:<\|[^|<>]*\|>\s*)*")


def compute_answer_match(response: str, label) -> float:
    m = _LEADING_INT.match(str(label))
    if m is None:
        raise ValueError(
            f"--rm-type answer_match needs labels that start with an integer, got {label!r}; "
            "use --rm-type math (boxed answers) or a custom --custom-rm-path for other answers."
        )
    answer = _WHOLE_INT.fullmatch(response or "")
    return 1.0 if answer is not None and int(answer.group(1)) == int(m.group(1)) else 0.0
