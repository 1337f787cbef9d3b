"""Reward graders: every normalisation rule decides a reward, so each is pinned on hand-worked cases."""

import asyncio
import sys
import time
import types

import pytest
from aiohttp import web

import slime.rollout.rm_hub as rm_hub
from slime.config import parse_args
from slime.rollout.rm_hub import RM_TYPES, async_rm, batched_async_rm, close_remote_rm_session, remote_rm
from slime.rollout.rm_hub import math_dapo_utils as dapo
from slime.rollout.rm_hub import math_utils as mu
from slime.rollout.rm_hub.answer_match import compute_answer_match
from slime.rollout.rm_hub.deepscaler import get_deepscaler_rule_based_reward
from slime.rollout.rm_hub.f1 import f1_score, normalize_answer
from slime.utils.async_utils import run
from slime.utils.http_utils import find_available_port
from slime.utils.types import Sample
from tests import _args


def make_args(**kw):
    return _args.make_args(**kw)


def rm(rm_type, response, label, **sample_kw):
    return run(async_rm(make_args(rm_type=rm_type), Sample(response=response, label=label, **sample_kw)), timeout=60)


# ---------------------------------------------------------------------------------------------------------------------
# math_utils: boxed extraction
# ---------------------------------------------------------------------------------------------------------------------


def test_boxed_extraction():
    assert mu.last_boxed_only_string(r"\boxed{a} then \boxed{b{c}} end") == r"\boxed{b{c}}"
    assert mu.last_boxed_only_string(r"x \fbox{3} y") == r"\fbox{3}"  # \fbox only when there is no \boxed
    assert mu.last_boxed_only_string(r"\fbox{1} \boxed{2}") == r"\boxed{2}"
    assert mu.last_boxed_only_string(r"\boxed{3") is None  # unterminated
    assert mu.last_boxed_only_string("no box") is None
    assert mu.remove_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert mu.remove_boxed(r"\fbox{3}") is None and mu.remove_boxed(None) is None and mu.remove_boxed("5") is None
    assert mu.extract_answer(r"so \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert mu.extract_answer(r"\fbox{3}") is None  # extract_answer requires the word \boxed
    assert mu.extract_answer("42") is None


# ---------------------------------------------------------------------------------------------------------------------
# math_utils: Hendrycks mathd normalisation, steps 1-10 of _strip_string
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, expected",
    [
        # whole-string \text{} unwrap + strip
        ("  \\text{(B)} ", "(B)"),
        # 1. newlines, \!, \\, tfrac/dfrac, \left \right
        ("1\n2", "12"),
        ("1\\!000", "1000"),
        ("\\\\frac{1}{3}", "\\frac{1}{3}"),
        ("\\tfrac{1}{3}", "\\frac{1}{3}"),
        ("\\left(\\dfrac{1}{3},2\\right)", "(\\frac{1}{3},2)"),
        # 2. degrees and \$
        ("90^{\\circ}", "90"),
        ("90^\\circ", "90"),
        ("\\$10", "10"),
        # 3. units after "\text{ "
        ("5\\text{ cm}", "5"),
        # 4. percent
        ("50\\%", "50"),
        # 5. leading-dot decimals
        ("{.25}", "{0.25}"),
        (".25", "0.25"),
        ("", ""),
        # 6. short "x =" prefix dropped, a longer left side kept
        ("x = 5", "5"),
        ("k=\\frac{1}{3}", "\\frac{1}{3}"),
        ("abc=5", "abc=5"),
        # 7. \sqrt3 -> \sqrt{3}, then spaces removed
        ("\\sqrt3 + 1", "\\sqrt{3}+1"),
        ("\\sqrt{3}", "\\sqrt{3}"),
        # 8. shorthand fractions
        ("\\frac12", "\\frac{1}{2}"),
        ("\\frac1{72}", "\\frac{1}{72}"),
        ("\\frac1", "\\frac1"),  # too short to fix: left alone
        # 9. 0.5 -> \frac{1}{2} (also reached through step 5)
        ("0.5", "\\frac{1}{2}"),
        (".5", "\\frac{1}{2}"),
        # 10. a/b with integers only
        ("3/4", "\\frac{3}{4}"),
        ("3/x", "3/x"),
        ("1/2/3", "1/2/3"),
    ],
)
def test_mathd_normalize_answer_steps(raw, expected):
    assert mu.mathd_normalize_answer(raw) == expected


def test_mathd_normalize_failures_keep_the_stripped_input():
    assert mu.mathd_normalize_answer(None) is None
    # two "\text{ " unit blocks make _remove_right_units fail: the reference then returns the stripped raw answer
    assert mu.mathd_normalize_answer(" 1\\text{ m}+2\\text{ m} ") == "1\\text{ m}+2\\text{ m}"
    # a trailing bare \frac fails in _fix_fracs: raw answer (spaces NOT removed)
    assert mu.mathd_normalize_answer("1 + \\frac") == "1 + \\frac"
    assert mu.grade_answer_mathd("\\dfrac{1}{2}", "0.5")
    assert mu.grade_answer_mathd("x=3/4", "\\frac34")
    assert not mu.grade_answer_mathd("2", "2.0")  # mathd is purely textual


# ---------------------------------------------------------------------------------------------------------------------
# math_utils: _normalize (sympy path)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("\\text{Yes}", "yes"),  # \text{} unwrap + lowercase
        ("50\\%", "50"),
        ("\\$5", "5"),
        ("$7$", "7"),
        ("1 or 2", "1,2"),
        ("3 and 4", "3,4"),
        ("2 million", "2*10^6"),
        ("3 billion", "3*10^9"),
        ("1 trillion", "1*10^12"),
        ("5 meters", "5"),
        ("12 inches", "12"),
        ("3 feet^2", "3"),
        ("4 hours", "4"),
        ("30^\\circ", "30"),
        ("{5}", "5"),
        ("1,\\! 000", "1000"),
        ("5.0", "5"),  # integral float -> int
        ("\\frac{1}{2}", "1/2"),  # latex2text
        ("\\pi", "pi"),
        ("\\infty", "inf"),
        ("2\\times 3", "2*3"),
        ("2 \\cdot 3", "2*3"),
        ("- 3", "-3"),
        ("7 3/4", "7+3/4"),  # implicit mixed number
        ("ABC", "abc"),
        ("1,000,000", "1000000"),  # int-like with commas -> canonical int
        ("(1, 2)", "(1,2)"),
        (None, None),
    ],
)
def test_sympy_normalize(raw, expected):
    assert mu._normalize(raw) == expected


def test_split_tuple_and_thousands_commas():
    assert mu.split_tuple("(1,2]") == ["1", "2"]
    assert mu.split_tuple("(1,000,2)") == ["1000", "2"]  # thousands comma stripped first
    assert mu.split_tuple("5") == ["5"] and mu.split_tuple("") == []
    assert mu.split_tuple("((1,2))") == ["((1,2))"]  # nested brackets: not a flat tuple


@pytest.mark.parametrize(
    "given, gt, expected",
    [
        ("1+x", "x+1", True),  # sympy equality
        ("\\sqrt{8}", "2\\sqrt{2}", True),
        ("0.5", "\\frac{1}{2}", True),
        ("x^2", "x*x", True),
        ("1,000", "1000", True),
        ("2.0", "2", True),
        ("(1, 2)", "(1,2)", True),  # tuple, normalised equal
        ("(1000, 2)", "(1,000,2)", True),  # element-wise after thousands commas
        ("(0.5,3)", "(\\frac{1}{2},3)", True),  # element-wise sympy
        ("[1,2]", "(1,2)", False),  # interval brackets must match
        ("(1,2,3)", "(1,2)", False),  # element counts must match
        ("(2,1)", "(1,2)", False),
        ("2/4", "1/2", False),  # both fractions: string equality, no simplify
        ("\\frac{2}{4}", "\\frac{1}{2}", False),
        ("4/2", "2", False),  # integer gt needs an integer answer
        ("5.5", "5", False),
        ("a+b+c", "c+b+a", False),  # refused: more than 2 unknown letters
        ("", "5", False),
        ("5", None, False),
        ("1+", "1", False),  # parse error counts as not equal
    ],
)
def test_grade_answer_sympy(given, gt, expected):
    assert mu.grade_answer_sympy(given, gt) is expected


def test_sympy_eval_refusal_rules():
    assert mu.should_allow_eval("x^2+y")
    assert mu.should_allow_eval("sqrt(a)+frac(b)")  # "sqrt"/"frac" letters do not count
    assert not mu.should_allow_eval("a+b+c")
    assert not mu.should_allow_eval("x^{2}")
    assert not mu.should_allow_eval("x^(2)")
    assert not mu.should_allow_eval("2^3^4")
    assert not mu.should_allow_eval("x^12")
    assert mu.are_equal_under_sympy("x^2", "x*x")
    assert not mu.are_equal_under_sympy("x^12", "x^12")  # equal, but refused before sympy sees it


def test_grade_answer_verl():
    assert mu.grade_answer_verl("so \\boxed{\\frac{1}{2}}", "0.5")
    assert mu.grade_answer_verl("\\boxed{x+1}", "\\boxed{1+x}")  # boxed gt unwrapped
    assert mu.grade_answer_verl("\\boxed{7}", 7)  # numeric labels graded by their text
    assert not mu.grade_answer_verl("the answer is 7", "7")  # no box
    assert not mu.grade_answer_verl("\\boxed{7}", "")
    assert not mu.grade_answer_verl("\\boxed{7}", None)
    assert not mu.grade_answer_verl("\\boxed{8}", "7")


# ---------------------------------------------------------------------------------------------------------------------
# deepscaler
# ---------------------------------------------------------------------------------------------------------------------


def test_deepscaler_solution_selection():
    r = "<think>maybe \\boxed{3}</think>first</think> so \\boxed{4}"
    assert get_deepscaler_rule_based_reward(r, "4") == 1  # text after the LAST </think>
    assert get_deepscaler_rule_based_reward(r, "3") == 0
    r = "###Response it is \\boxed{4} ###Response \\boxed{5}"
    assert get_deepscaler_rule_based_reward(r, "4") == 1  # segment after the FIRST ###Response only
    assert get_deepscaler_rule_based_reward(r, "5") == 0
    assert get_deepscaler_rule_based_reward("\\boxed{4}", "4") == 0  # no </think> nor ###Response
    assert get_deepscaler_rule_based_reward("</think> 4", "4") == 0  # no box


def test_deepscaler_labels():
    ok = "</think> \\boxed{\\frac{1}{2}}"
    assert get_deepscaler_rule_based_reward(ok, "\\frac12") == 1  # mathd
    assert get_deepscaler_rule_based_reward(ok, 0.5) == 1  # float label stringified
    assert get_deepscaler_rule_based_reward(ok, "\\boxed{0.5}") == 1  # boxed label unwrapped
    assert get_deepscaler_rule_based_reward("</think> \\boxed{1+x}", "x+1") == 1  # sympy
    assert get_deepscaler_rule_based_reward("</think> \\boxed{7}", 7) == 1
    assert get_deepscaler_rule_based_reward(ok, "") == 0
    with pytest.raises(TypeError, match="label"):
        get_deepscaler_rule_based_reward(ok, ["0.5"])


# ---------------------------------------------------------------------------------------------------------------------
# dapo
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("x = 10", "10"),  # part after the last "="
        ("\\$1,000", "1000"),  # \$ removed, digits-with-commas lose commas
        ("1,2,3", "123"),
        ("(1,2)", "(1,2)"),
        ("5 dollars", "5"),  # spaces removed, then the unit word
        ("an apple", "apple"),
        ("a cat", "cat"),
        ("7.$", "7"),
        ("x\\text{and}y", "x,y"),
        ("x,\\text{and}y", "x,y"),
        ("3\\mbox{ cm}", "3"),  # mbox -> text, unit removed, \text{} removed
        ("5\\text{m}", "5"),
        ("90^\\circ", "90"),
        ("90^{\\circ}", "90"),
        ("1{,}000", "1000"),
        ('"yes"', "yes"),
        ("1,2,\\ldots", "12"),
        ("$\\boxed{7}$", "7"),  # $...$ kept, boxed unwrapped
        ("see $42$ here", "42"),
        ("\\text{(A)}", "(A)"),
        ("\\textbf{12}", "12"),
        ("\\overline{3}", "3"),
        ("\\frac12", "\\frac{1}{2}"),
        ("\\sqrt2", "\\sqrt{2}"),
        ("7<|im_end|>", "7"),
        (7, "7"),
    ],
)
def test_dapo_normalize_final_answer(raw, expected):
    assert dapo.normalize_final_answer(raw) == expected


def test_dapo_minerva_scoring():
    assert dapo.compute_score("so\nAnswer: 5", "5") == {"score": 1.0, "acc": True, "pred": "5"}
    assert dapo.compute_score("Answer: 3\nwait\nanswer : $5$ dollars", "5")["acc"]  # last match, case-insensitive
    assert dapo.compute_score("Answer: 3\nAnswer: 5", "3")["score"] == -1.0
    assert dapo.compute_score("no final line", "5") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert dapo.compute_score("Answer: 1,000", "1000")["acc"]
    assert dapo.compute_score("Answer: x = \\frac12", "\\frac{1}{2}")["acc"]
    # only the last 300 characters are looked at
    assert not dapo.compute_score("Answer: 5\n" + "." * 300, "5")["acc"]
    assert dapo.compute_score("." * 400 + "\nAnswer: 5", "5")["acc"]


@pytest.mark.parametrize("label", ["5", "5.0", "05", "5e0", 5, 5.0])
def test_dapo_labels_are_whole_numbers(label):
    assert dapo.compute_score("Answer: 5", label)["acc"]


def test_dapo_non_integer_labels_are_compared_as_written():
    assert dapo.compute_score("Answer: 42.5", "42.5")["acc"]
    assert not dapo.compute_score("Answer: 42", "42.5")["acc"]  # not truncated to 42
    assert dapo.compute_score("Answer: \\frac{1}{2}", "\\frac{1}{2}")["acc"]


def test_dapo_strict_box():
    assert dapo.compute_score("work... \\boxed{42}", "42", strict_box_verify=True) == {
        "score": 1.0,
        "acc": True,
        "pred": "42",
    }
    assert dapo.compute_score("\\boxed{42}" + "." * 100, "42", strict_box_verify=True) == {
        "score": -1.0,
        "acc": False,
        "pred": None,
    }  # box outside the last 100 characters
    assert dapo.compute_score("\\boxed{ 42}", "42", strict_box_verify=True)["score"] == -1.0  # exact string compare
    text = "\\boxed{1}" + "." * 150 + "\\boxed{2}" + "." * 150
    assert dapo.is_correct_strict_box(text, "2", pause_tokens_index=[0, 0, 0, 170]) == (1, "2")
    assert dapo.last_boxed_only_string("\\fbox{3}") is None  # dapo's variant ignores \fbox
    with pytest.raises(AssertionError, match="box error"):
        dapo.remove_boxed("5")


# ---------------------------------------------------------------------------------------------------------------------
# f1
# ---------------------------------------------------------------------------------------------------------------------


def test_f1_normalize_and_score():
    assert normalize_answer("The  cat, a DOG; an owl.") == "cat dog owl"
    assert normalize_answer("the-end") == "theend"  # punctuation removed before articles
    assert f1_score("The Eiffel Tower!", "eiffel tower") == (1.0, 1.0, 1.0)
    f1, p, r = f1_score("Paris France", "Paris")
    assert (p, r) == (0.5, 1.0) and f1 == pytest.approx(2 / 3)
    f1, p, r = f1_score("x y y", "y y z")  # multiset overlap: 2
    assert p == pytest.approx(2 / 3) and r == pytest.approx(2 / 3) and f1 == pytest.approx(2 / 3)
    assert f1_score("Berlin", "Paris") == (0, 0, 0)
    assert f1_score(None, "Paris") == (0, 0, 0)


def test_f1_yes_no_noanswer():
    assert f1_score("Yes.", "yes") == (1.0, 1.0, 1.0)
    assert f1_score("yes", "no") == (0, 0, 0)
    assert f1_score("yes", "yes it is") == (0, 0, 0)  # special prediction must match exactly
    assert f1_score("no it is not", "no") == (0, 0, 0)  # special gold must match exactly
    assert f1_score("no answer", "noanswer") == (0, 0, 0)


# ---------------------------------------------------------------------------------------------------------------------
# answer_match (slime-clone specific)
# ---------------------------------------------------------------------------------------------------------------------


def test_answer_match():
    assert compute_answer_match(" 7", "7") == 1.0
    assert compute_answer_match("7\n", 7) == 1.0
    assert compute_answer_match("7<|im_end|>", 7) == 1.0  # special tokens kept in the text are not part of the answer
    assert compute_answer_match("7<|im_end|>8", 7) == 0.0
    assert compute_answer_match("7 apples", 7) == 0.0  # the whole response must be the number
    assert compute_answer_match("-3", "-3") == 1.0
    assert compute_answer_match("007", "7") == 1.0  # integers compared, not strings
    assert compute_answer_match("-3", "3") == 0.0
    assert compute_answer_match("The answer is 7", "7") == 0.0
    assert compute_answer_match("", "7") == 0.0
    with pytest.raises(ValueError, match="answer_match"):
        compute_answer_match("7", "seven")


# ---------------------------------------------------------------------------------------------------------------------
# ifbench: IFBench's verifiers, driven as its strict evaluation drives them
# ---------------------------------------------------------------------------------------------------------------------

# IFBench cannot be installed here (it is not on PyPI and GitHub is out of reach), so a package with its layout and its
# verifiers' interface stands in: `instructions_registry.INSTRUCTION_DICT` of classes built with the instruction id,
# then `build_description(**kwargs)`, `get_instruction_args()`, `check_following(response)`.
IFBENCH_REGISTRY = """
class MinWords:  # a None N would fail: the reward must drop None kwargs so that the default applies
    def __init__(self, instruction_id):
        self.id = instruction_id

    def build_description(self, *, N=3):
        self.n = N

    def get_instruction_args(self):
        return {"N": self.n}

    def check_following(self, value):
        return len(value.split()) >= self.n


class RepeatPrompt:  # quotes the prompt: IFBench's strict evaluation builds it a second time with prompt=
    def __init__(self, instruction_id):
        self.prompt = None

    def build_description(self, *, prompt=None):
        self.prompt = prompt

    def get_instruction_args(self):
        return {"prompt": self.prompt}

    def check_following(self, value):
        return value.startswith(self.prompt)


INSTRUCTION_DICT = {"length:min_words": MinWords, "repeat:prompt": RepeatPrompt}
"""


@pytest.fixture
def ifbench_pkg(tmp_path, monkeypatch):
    """A directory holding the stand-in `ifbench` package (not yet importable); IFBench's clone location moved into
    tmp_path, and what the test imports of it forgotten afterwards."""
    from slime.rollout.rm_hub import ifbench

    root = tmp_path / "site"
    (root / "ifbench").mkdir(parents=True)
    (root / "ifbench" / "__init__.py").write_text("")
    (root / "ifbench" / "instructions_registry.py").write_text(IFBENCH_REGISTRY)
    monkeypatch.setattr(ifbench, "CLONE_DIR", tmp_path / "IFBench")
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in [m for m in sys.modules if m == "ifbench" or m.startswith("ifbench.")]:
        monkeypatch.delitem(sys.modules, name)
    yield root
    for name in [m for m in sys.modules if m == "ifbench" or m.startswith("ifbench.")]:
        del sys.modules[name]


def ifbench_reward(response, ids, kwargs, prompt="Say hi"):
    meta = {"rm_type": "ifbench", "instruction_id_list": ids, "kwargs": kwargs, "prompt_text": prompt}
    return rm(None, response, None, metadata=meta)


def test_ifbench_reward_follows_every_instruction_as_ifbench_strict_does(ifbench_pkg, monkeypatch):
    monkeypatch.syspath_prepend(str(ifbench_pkg))
    both = ["length:min_words", "repeat:prompt"]
    assert ifbench_reward("Say hi to all", both, [{"N": 4}, {"prompt": None}]) == 1.0
    assert ifbench_reward("Say hi all", both, [{"N": 4}, {}]) == 0.0  # 3 words
    assert ifbench_reward("Hi, say hi to all", both, [{"N": 4}, {}]) == 0.0  # does not repeat the prompt
    # None values mean the verifier's default (N=3); one dict serves every instruction; a short list repeats its last
    assert ifbench_reward("a b", ["length:min_words"], [{"N": None}]) == 0.0
    assert ifbench_reward("a b c", ["length:min_words"], [{"N": None}]) == 1.0
    assert ifbench_reward("Say hi", ["length:min_words"] * 2, {"N": 2}) == 1.0
    assert ifbench_reward("Say hi", ["length:min_words"] * 2, {"N": 3}) == 0.0
    assert ifbench_reward("Say hi", ["length:min_words"] * 2, [{"N": 1}]) == 1.0
    assert ifbench_reward("Say hi", ["length:min_words"] * 2, [{"N": 1}, {"N": 5}]) == 0.0
    assert ifbench_reward("Say hi", ["length:min_words"], [{"N": 1}, {"N": 5}]) == 1.0  # a longer list is cut
    # an empty response, and a sample without instructions, score 0 without a verifier
    assert ifbench_reward("  \n", both, [{"N": 0}, {"prompt": ""}]) == 0.0
    assert ifbench_reward("Say hi", [], []) == 0.0
    with pytest.raises(ValueError, match="no instruction 'length:max_words'"):
        ifbench_reward("Say hi", ["length:max_words"], [{}])


def test_ifbench_verifiers_come_from_a_clone_where_current_slime_puts_it(ifbench_pkg):
    from slime.rollout.rm_hub import ifbench

    ifbench_pkg.rename(ifbench.CLONE_DIR)
    assert ifbench_reward("Say hi", ["repeat:prompt"], [{}]) == 1.0


def test_ifbench_without_its_verifiers_or_nltk_data_stops_at_start_up(ifbench_pkg, tmp_path, capsys, monkeypatch):
    import nltk

    from tests.test_startup_checks import error_line

    config = tmp_path / "eval.yaml"
    config.write_text(
        f"eval:\n  datasets:\n    - name: ifb\n      path: {_args.TINY_PROMPTS}\n      rm_type: ifbench\n"
    )
    from slime.rollout.rm_hub.ifbench import INSTALL

    assert error_line(capsys, "--rm-type", "ifbench").startswith("--rm-type ifbench: rm_type ifbench needs IFBench's")
    assert INSTALL in error_line(capsys, "--rm-type", "ifbench")
    assert error_line(capsys, "--eval-config", str(config)).startswith("eval dataset 'ifb' ifbench: ")

    monkeypatch.syspath_prepend(str(ifbench_pkg))
    (ifbench_pkg / "ifbench" / "__init__.py").write_text("import nltk\n")  # as IFBench's verifiers do
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "nltk_data")])
    for resource in ("tokenizers/punkt", "corpora/stopwords"):
        (tmp_path / "nltk_data" / resource).mkdir(parents=True)
    assert error_line(capsys, "--rm-type", "ifbench") == (
        "--rm-type ifbench: IFBench's verifiers need NLTK data that is not installed: python -m nltk.downloader "
        "punkt_tab averaged_perceptron_tagger_eng"
    )
    for resource in ("tokenizers/punkt_tab", "taggers/averaged_perceptron_tagger_eng"):
        (tmp_path / "nltk_data" / resource).mkdir(parents=True)
    args = parse_args(argv=[*_args.BASE, *_args.TINY_MODEL, "--rm-type", "ifbench", "--eval-config", str(config)])
    assert args.rm_type == "ifbench" and args.eval_datasets[0].rm_type == "ifbench"


# ---------------------------------------------------------------------------------------------------------------------
# async_rm dispatch
# ---------------------------------------------------------------------------------------------------------------------


def test_dispatch_each_type():
    assert rm("math", "so \\boxed{7}", "7") == 1
    assert rm("math", "so 7", "7") == 0
    assert rm("deepscaler", "</think>\\boxed{7}", "7") == 1
    assert rm("dapo", "Answer: 7", "7") == {"score": 1.0, "acc": True, "pred": "7"}
    assert rm("f1", "paris", "Paris") == 1.0
    assert rm("answer_match", "7", "7") == 1.0


def test_boxed_prefix():
    assert rm("boxed_f1", "I think it is \\boxed{Paris}", "Paris") == 1.0
    assert rm("f1", "I think it is \\boxed{Paris}", "Paris") == 0  # without the prefix the whole text is graded
    assert rm("boxed_answer_match", "3+4 is \\boxed{7}", "7") == 1.0
    assert rm("answer_match", "3+4 is \\boxed{7}", "7") == 0.0
    assert rm("boxed_f1", "no box here", "here") == 0  # missing box -> ""


def test_metadata_rm_type_takes_precedence():
    assert rm("math", "paris", "Paris", metadata={"rm_type": "f1"}) == 1.0
    assert rm(None, "x \\boxed{Paris}", "Paris", metadata={"rm_type": "boxed_f1"}) == 1.0


def test_missing_and_unknown_types():
    with pytest.raises(NotImplementedError, match="not specified"):
        rm(None, "7", "7")
    with pytest.raises(NotImplementedError) as e:
        rm("bogus", "7", "7")
    assert "'bogus'" in str(e.value) and all(t in str(e.value) for t in RM_TYPES)
    with pytest.raises(NotImplementedError, match="'nope'"):
        rm("boxed_nope", "7", "7")


def test_batched_rule_rm_keeps_order():
    samples = [Sample(response=r, label="7") for r in ("\\boxed{7}", "\\boxed{8}", "\\boxed{7.0}")]
    assert run(batched_async_rm(make_args(rm_type="math"), samples), timeout=60) == [1, 0, 1]


# Custom RMs loaded by dotted path (this module is importable as tests.test_rm_hub).
async def custom_rm(args, sample, **kwargs):
    return {"len": len(sample.response), "kw": sorted(kwargs)}


async def custom_group_rm(args, samples, **kwargs):
    return [float(i) for i, _ in enumerate(samples)]


async def custom_bad_group_rm(args, samples, **kwargs):
    return [1.0]


def test_custom_rm_by_path():
    args = make_args(rm_type="math", custom_rm_path="tests.test_rm_hub.custom_rm")  # custom path wins over rm_type
    assert run(async_rm(args, Sample(response="abcd"), evaluation=True), timeout=30) == {
        "len": 4,
        "kw": ["evaluation"],
    }
    group = [Sample(response="a"), Sample(response="b"), Sample(response="c")]
    args = make_args(custom_rm_path="tests.test_rm_hub.custom_group_rm")
    assert run(batched_async_rm(args, group), timeout=30) == [0.0, 1.0, 2.0]  # one call with the whole list
    args = make_args(custom_rm_path="tests.test_rm_hub.custom_bad_group_rm")
    with pytest.raises(ValueError, match="custom_bad_group_rm"):
        run(batched_async_rm(args, group), timeout=30)
    with pytest.raises(ImportError, match="no_such_rm"):
        run(async_rm(make_args(custom_rm_path="tests.test_rm_hub.no_such_rm"), Sample()), timeout=30)


# ---------------------------------------------------------------------------------------------------------------------
# remote_rm against a real aiohttp server on 127.0.0.1
# ---------------------------------------------------------------------------------------------------------------------


class _RMServer:
    def __init__(self):
        self.flaky_times: list[float] = []
        self.received: list[dict] = []

    def app(self):
        app = web.Application()
        app.router.add_post("/reward", self.reward)
        app.router.add_post("/flaky", self.flaky)
        app.router.add_post("/bad", self.bad)
        app.router.add_post("/text", self.text)
        app.router.add_post("/slow", self.slow)
        return app

    async def reward(self, request):
        payload = await request.json()
        self.received.append(payload)
        return web.json_response({"score": 1.0 if payload["response"].strip() == payload["label"] else 0.0})

    async def flaky(self, request):
        self.flaky_times.append(time.monotonic())
        if len(self.flaky_times) < 4:
            return web.Response(status=503, text="warming up")
        return web.json_response(0.75)

    async def bad(self, request):
        return web.json_response({"error": "bad label"}, status=422)

    async def text(self, request):
        return web.Response(text="not json")

    async def slow(self, request):
        await asyncio.sleep(1.0)  # > the client's 0.3 s timeout; short so server cleanup need not wait long
        return web.json_response(1.0)


@pytest.fixture(scope="module")
def rm_server():
    server = _RMServer()
    port = find_available_port(20000)

    async def start():
        runner = web.AppRunner(server.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = run(start(), timeout=30)
    yield server, f"http://127.0.0.1:{port}"
    run(close_remote_rm_session(), timeout=30)
    run(runner.cleanup(), timeout=30)


def test_remote_rm_posts_prompt_response_label(rm_server):
    server, base = rm_server
    args = make_args(rm_type="remote_rm", rm_url=f"{base}/reward")
    prompt = [{"role": "user", "content": "What is 3+4?"}]
    samples = [Sample(prompt=prompt, response=" 7", label="7"), Sample(prompt=prompt, response="8", label="7")]
    assert run(batched_async_rm(args, samples), timeout=30) == [{"score": 1.0}, {"score": 0.0}]
    assert {"prompt": prompt, "response": " 7", "label": "7"} in server.received


def test_remote_rm_retries_with_exponential_backoff(rm_server, monkeypatch):
    server, base = rm_server
    # the delays remote_rm asks for, recorded: how long a retry then takes on the wall clock depends on the load
    delays, real_sleep = [], asyncio.sleep

    async def recording_sleep(delay, *a, **kw):
        delays.append(delay)
        return await real_sleep(delay, *a, **kw)

    monkeypatch.setattr(rm_hub, "asyncio", types.SimpleNamespace(**{**vars(asyncio), "sleep": recording_sleep}))
    args = make_args(rm_url=f"{base}/flaky")
    reward = run(remote_rm(args, Sample(), max_retries=5, backoff=0.1, max_backoff=0.25), timeout=30)
    assert reward == 0.75 and len(server.flaky_times) == 4  # 3 x 503, then success
    # delays 0.1, 0.2, then capped at 0.25 (an uncapped third would be 0.4), each plus <= 10% jitter
    assert len(delays) == 3 and all(1 <= d / base_delay <= 1.1 for d, base_delay in zip(delays, [0.1, 0.2, 0.25]))
    # and they were waited: each retry reached the server no sooner (a wall-clock lower bound holds under any load)
    gaps = [b - a for a, b in zip(server.flaky_times, server.flaky_times[1:])]
    assert all(g >= d for g, d in zip(gaps, delays)), (gaps, delays)


def test_remote_rm_errors_name_the_url(rm_server):
    _, base = rm_server
    with pytest.raises(RuntimeError, match=r"/bad rejected the request with HTTP 422"):
        run(remote_rm(make_args(rm_url=f"{base}/bad"), Sample(), backoff=0.01), timeout=30)
    with pytest.raises(RuntimeError, match=r"/text answered non-JSON"):
        run(remote_rm(make_args(rm_url=f"{base}/text"), Sample(), backoff=0.01), timeout=30)
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=r"/slow failed after 2 attempt\(s\): \w*Timeout"):
        run(
            remote_rm(make_args(rm_url=f"{base}/slow"), Sample(), max_retries=2, timeout=0.3, backoff=0.01), timeout=30
        )
    assert time.monotonic() - t0 < 3
    dead = f"http://127.0.0.1:{find_available_port(30000)}/reward"
    with pytest.raises(ConnectionError, match=rf"{dead} failed after 3 attempt"):
        run(remote_rm(make_args(rm_url=dead), Sample(), max_retries=3, backoff=0.01), timeout=30)
    with pytest.raises(ValueError, match="--rm-url"):
        run(async_rm(make_args(rm_type="remote_rm"), Sample()), timeout=30)
