"""Inference-engine side of slime: `SGLangEngine` Ray actors (SGLang on GPU, slime's CPU server otherwise), the
sglang-router helpers and the `--sglang-*` argument pass-through."""
