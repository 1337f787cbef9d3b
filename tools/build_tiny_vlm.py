"""Build a tiny offline Qwen2.5-VL, in one directory, in seconds: a random ~0.2M-parameter model and its processor (a
PIL image processor plus a byte-BPE tokenizer with Qwen's vision special tokens). `--family qwen3_vl` builds a
Qwen3-VL instead (DeepStack features from two vision layers, interleaved MRoPE, qk-norm, an untied LM head);
`--family qwen3_5` / `qwen3_5_moe` a Qwen3.5 (-MoE) with its vision tower (the Gated DeltaNet hybrid decoder, partial
interleaved MRoPE); `--family qwen3_vl_moe` a Qwen3-VL-MoE (Qwen3-VL with routed experts, stacked as published).

The processor is saved image-only (transformers' video processors need torchvision) with the family's video processor
config beside it; `slime.utils.processing_utils.load_processor` loads both.

    python tools/build_tiny_vlm.py --model-dir models/qwen2.5-vl-tiny
    python tools/build_tiny_vlm.py --family qwen3_vl --model-dir models/qwen3-vl-tiny
"""

import argparse
import json
import os

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]  # ids 0..6
# Qwen2.5-VL's own template, shortened: an image content item renders as <|vision_start|><|image_pad|><|vision_end|>.
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' or 'image' in item %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'video' or 'video' in item %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'text' %}{{- item['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MERGE, TEMPORAL = 2, 2
PATCH = {
    "qwen2_5_vl": 14,
    "qwen3_vl": 16,
    "qwen3_vl_moe": 16,
    "qwen3_5": 16,
    "qwen3_5_moe": 16,
}  # the families' own patch sizes


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # heavy
    from transformers import PreTrainedTokenizerFast  # heavy

    corpus = [
        "<|im_start|>user\nWhat colour is the shape? What shape is it? Answer red, green, blue or yellow; "
        "circle, square or triangle.<|im_end|>\n<|im_start|>assistant\nred circle<|im_end|>\n"
    ] * 50 + ["The quick brown fox jumps over the lazy dog. Describe the image. 0123456789"] * 20
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.model_max_length = 1024
    return hf_tok


def build_processor(family="qwen2_5_vl"):
    from transformers import Qwen2VLImageProcessorPil  # heavy

    from slime.utils.processing_utils import ImageOnlyQwenVLProcessor

    side = PATCH[family] * MERGE  # pixels per image token, each way
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH[family],
        merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
        # 1 image token (28x28 px for Qwen2.5-VL) up to 16 (112x112)
        size={"shortest_edge": side * side, "longest_edge": 16 * side * side},
    )
    return ImageOnlyQwenVLProcessor(
        image_processor=image_processor, tokenizer=build_tokenizer(), chat_template=CHAT_TEMPLATE
    )


def video_processor_config(family):
    """The video processor's config (transformers' class defaults but a small frame: at most 16 tokens per 2 frames)."""
    from slime.utils.video_processing import DEFAULTS

    kind = "Qwen2VLVideoProcessor" if family == "qwen2_5_vl" else "Qwen3VLVideoProcessor"
    side = PATCH[family] * MERGE
    config = dict(DEFAULTS[kind], video_processor_type=kind, merge_size=MERGE, temporal_patch_size=TEMPORAL)
    return dict(config, size={"shortest_edge": side * side, "longest_edge": 16 * side * side})


def _tower(family, **extra):
    """The vision tower's config: 2 heads of 16, merged 2x2 into the decoder's width (64)."""
    base = dict(hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=PATCH[family])
    return dict(base, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, **extra)


def _qwen2_5_vl_config(text, ids):
    from transformers import Qwen2_5_VLConfig  # heavy

    # head_dim 16 -> 8 rotary frequencies, split (t, h, w) in contiguous sections
    text["rope_scaling"] = {"type": "mrope", "rope_type": "default", "mrope_section": [2, 3, 3]}
    vision = _tower("qwen2_5_vl", depth=2, window_size=56, fullatt_block_indexes=[1], in_chans=3)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)


def _qwen3_vl_config(text, ids, moe=False):
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig  # heavy

    # 8 rotary frequencies interleaved t h w t h w t t (sections [4, 2, 2]); an untied LM head, as in Qwen3-VL-8B;
    # 3 layers: what DeepStack adds to the last layer's output at the image tokens reaches no response token
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    text.update(num_hidden_layers=3, head_dim=16, tie_word_embeddings=False, rope_parameters=rope)
    vision = _tower(
        "qwen3_vl",
        depth=3,
        num_position_embeddings=16,  # a 4x4 learned grid, interpolated to each image's
        deepstack_visual_indexes=[0, 2],  # added to the outputs of decoder layers 0 and 1
        in_channels=3,
    )
    if (
        moe
    ):  # Qwen3-VL-30B-A3B's shape: every layer routed (softmax top-2 of 4 experts, renormalised), no shared expert
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1)
        return Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)


def _qwen3_5_config(text, ids, moe=False):
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig  # heavy

    # the hybrid decoder: a Gated DeltaNet layer, then a gated full-attention layer with partial (1/4) interleaved
    # MRoPE over 8 frequencies; no DeepStack
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    text.update(
        head_dim=64,
        tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_conv_kernel_dim=4,
        rope_parameters=dict(rope, mrope_section=[4, 2, 2], mrope_interleaved=True),
    )
    vision = _tower("qwen3_5", depth=2, num_position_embeddings=16, in_channels=3)
    if moe:  # every layer: softmax top-2 of 4 experts and a gated shared expert, no dense MLP
        text.pop("intermediate_size")
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
        return Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)


_CONFIGS = {
    "qwen2_5_vl": _qwen2_5_vl_config,
    "qwen3_vl": _qwen3_vl_config,
    "qwen3_vl_moe": lambda text, ids: _qwen3_vl_config(text, ids, moe=True),
    "qwen3_5": _qwen3_5_config,
    "qwen3_5_moe": lambda text, ids: _qwen3_5_config(text, ids, moe=True),
}


def _publish_expert_layout(model_dir):
    """Qwen3-VL-MoE's experts as its published checkpoints hold them, `gate_up_proj` [E, H, 2I] and `down_proj`
    [E, I, H] (transformers saves its in-memory [E, 2I, H] / [E, H, I]; it loads either, SGLang only the published)."""
    from safetensors.torch import load_file, save_file  # heavy

    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    for name in tensors:
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


def build_model(model_dir, seed=0, family="qwen2_5_vl"):
    import torch  # heavy
    from transformers import AutoModelForImageTextToText  # heavy

    os.makedirs(model_dir, exist_ok=True)
    processor = build_processor(family)
    tok = processor.tokenizer
    ids = {name: tok.convert_tokens_to_ids(name) for name in SPECIALS}
    vocab_size = (len(tok) + 127) // 128 * 128
    text = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=True,
    )
    special = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        torch_dtype="float32",
    )
    cfg = _CONFIGS[family](text, special)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg)
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(model_dir)
    if family == "qwen3_vl_moe":
        _publish_expert_layout(model_dir)
    processor.save_pretrained(model_dir)
    with open(os.path.join(model_dir, "video_preprocessor_config.json"), "w") as f:
        json.dump(video_processor_config(family), f, indent=2, sort_keys=True)
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.exists(cfg_path):  # transformers 5 writes "TokenizersBackend"; this class gives the same ids
        with open(cfg_path) as f:
            tcfg = json.load(f)
        tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        with open(cfg_path, "w") as f:
            json.dump(tcfg, f, indent=2, sort_keys=True)
    return model_dir


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default="models/qwen2.5-vl-tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--family", choices=sorted(_CONFIGS), default="qwen2_5_vl")
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    build_model(a.model_dir, a.seed, a.family)
    print(f"tiny {a.family} in {a.model_dir}")


if __name__ == "__main__":
    main()
