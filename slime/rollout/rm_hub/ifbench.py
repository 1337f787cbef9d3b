"""IFBench instruction following (current slime's `ifbench`): 1.0 when the response follows every instruction of the
sample under IFBench's strict rules, else 0.0.

The sample's metadata names the instructions as the IFBench eval data does: `instruction_id_list`, `kwargs` (one dict
per instruction, or one dict for all), `prompt_text` (for the instructions that quote the prompt). The verifiers are
IFBench's own (https://github.com/allenai/IFBench), from its `ifbench` package or from a clone next to this repository
(where current slime clones it). Nothing is downloaded at run time: without them, or without the NLTK data they read,
the run stops at start-up saying what to install.
"""

import importlib
import sys
from pathlib import Path

INSTALL = 'pip install "ifbench @ git+https://github.com/allenai/IFBench"'
CLONE_DIR = Path(__file__).resolve().parents[3].parent / "IFBench"
# What IFBench's verifiers load from NLTK (its instructions_util tries to download them at import).
NLTK_DATA = {
    "tokenizers/punkt": "punkt",
    "tokenizers/punkt_tab": "punkt_tab",
    "corpora/stopwords": "stopwords",
    "taggers/averaged_perceptron_tagger_eng": "averaged_perceptron_tagger_eng",
}


def _registry():
    """IFBench's instruction id -> verifier class."""
    try:
        return importlib.import_module("ifbench.instructions_registry").INSTRUCTION_DICT
    except ModuleNotFoundError as e:
        if e.name != "ifbench":
            raise ImportError(
                f"IFBench's verifiers need {e.name!r}, which is not installed: pip install {e.name}"
            ) from e
        if not (CLONE_DIR / "ifbench").is_dir() or str(CLONE_DIR) in sys.path:
            raise ImportError(
                f"rm_type ifbench needs IFBench's verifiers: {INSTALL} (or clone it to {CLONE_DIR})"
            ) from e
    sys.path.insert(0, str(CLONE_DIR))
    return _registry()


def missing() -> str | None:
    """Why IFBench cannot score on this machine (one line), or None when it can."""
    try:
        _registry()
    except ImportError as e:
        return str(e)
    nltk = sys.modules.get("nltk")  # only when IFBench's verifiers use it
    if nltk is None:
        return None
    absent = []
    for resource, package in NLTK_DATA.items():
        try:
            nltk.data.find(resource)
        except LookupError:
            absent.append(package)
    if absent:
        return (
            f"IFBench's verifiers need NLTK data that is not installed: python -m nltk.downloader {' '.join(absent)}"
        )
    return None


def _kwargs_per_instruction(raw, n):
    """`raw` (a list of dicts, one dict for all, or nothing) as n dicts without None values: a list shorter than the
    instructions repeats its last entry, a longer one is cut, and a None value means the verifier's default."""
    if isinstance(raw, dict):
        entries = [raw] * n
    elif isinstance(raw, list):
        entries = [e if isinstance(e, dict) else {} for e in raw][:n]
        entries += [entries[-1] if entries else {}] * (n - len(entries))
    else:
        entries = [{}] * n
    return [{k: v for k, v in e.items() if v is not None} for e in entries]


def compute_ifbench_reward(response, label, metadata=None) -> float:
    """1.0 when `response` follows every instruction in `metadata` (IFBench strict), else 0.0; `label` is unused."""
    metadata = metadata or {}
    ids = [str(i).strip() for i in metadata.get("instruction_id_list") or [] if i is not None and str(i).strip()]
    if not ids or not response or not str(response).strip():
        return 0.0
    response, prompt = str(response), str(metadata.get("prompt_text") or "")
    registry = _registry()
    for instruction_id, kwargs in zip(ids, _kwargs_per_instruction(metadata.get("kwargs"), len(ids)), strict=True):
        if instruction_id not in registry:
            raise ValueError(
                f"IFBench has no instruction {instruction_id!r} (the sample's metadata instruction_id_list)"
            )
        instruction = registry[instruction_id](instruction_id)
        instruction.build_description(**kwargs)
        if "prompt" in (instruction.get_instruction_args() or {}):
            instruction.build_description(prompt=prompt)
        if not instruction.check_following(response):
            return 0.0
    return 1.0
