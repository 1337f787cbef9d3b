"""GPQA-style multiple choice: 1.0 when the response picks the correct option, else 0.0 (current slime's `gpqa`).

The correct option is `metadata["correct_letter"]`, else the label: a letter, an option index, or the text of one of
`metadata["choices"]`. The response's pick is what follows "answer is" / "option:" (or precedes "is correct"), else
its last standalone option letter; reasoning before a closing `</think>` is ignored. Without a letter on either side,
the response counts as correct when it contains the correct option's text.
"""

import re
import string

_LETTER_PATTERNS = (
    r"(?:answer|option|choice)\s*(?:is|:)?\s*\(?([A-Z])\b",
    r"\b([A-Z])\)?\s*is\s*(?:the\s*)?correct",
)


def _final_part(text):
    return text.rsplit("</think>", 1)[-1] if "</think>" in text else text


def _norm(text):
    # letters and digits of any script ("上海", "α" keep theirs); punctuation and symbols are separators
    return re.sub(r"[\W_]+", " ", str(text).lower()).strip()


def _picked_letter(response, letters):
    text = _final_part(response)
    for pattern in _LETTER_PATTERNS:
        m = re.search(pattern, text, flags=re.IGNORECASE)
        if m and m.group(1).upper() in letters:
            return m.group(1).upper()
    for letter in reversed(re.findall(r"\b([A-Z])\b", text)):
        if letter in letters:
            return letter
    return None


def compute_gpqa_reward(response, label, metadata=None):
    if not response:
        return 0.0
    metadata = metadata or {}
    choices = metadata.get("choices")
    choices = list(choices.values()) if isinstance(choices, dict) else list(choices or [])
    if metadata.get("valid_letters"):
        letters = [str(x).upper() for x in metadata["valid_letters"]]
    else:
        letters = list(string.ascii_uppercase[: len(choices) or 10])

    correct = metadata.get("correct_letter")
    correct = correct.strip().upper() if isinstance(correct, str) else None
    label_text = label.strip() if isinstance(label, str) else None
    if correct is None:
        if label_text and len(label_text) == 1 and label_text.upper() in letters:
            correct = label_text.upper()
        elif isinstance(label, (int, float)) and not isinstance(label, bool) and 0 <= int(label) < len(letters):
            correct = letters[int(label)]
        elif label_text:
            label_norm = _norm(label_text)
            correct = next((letters[i] for i, c in enumerate(choices) if label_norm and _norm(c) == label_norm), None)

    picked = _picked_letter(response, set(letters))
    if picked and correct:
        return 1.0 if picked == correct else 0.0
    targets = [metadata.get("correct_answer"), metadata.get("answer_text"), label_text]
    if correct in letters and letters.index(correct) < len(choices):
        targets.append(choices[letters.index(correct)])
    answer = _norm(_final_part(response))
    targets = [_norm(t) for t in targets if t]
    return 1.0 if any(t and t in answer for t in targets) else 0.0  # a target of symbols only matches nothing
