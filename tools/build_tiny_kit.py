"""Build the tiny offline Qwen3 kit: a ~1M-parameter Qwen3 HF directory and a single-digit addition task.

Deterministic and offline (no hub): the same files byte for byte on every run. Loads only through
AutoTokenizer / AutoConfig / AutoModelForCausalLM.from_pretrained(model_dir).

    python tools/build_tiny_kit.py --model-dir models/qwen3-tiny --data-dir data/addition
"""

import argparse
import json
import os
import random

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def question(a, b):
    return f"What is {a}+{b}?"


def build_tokenizer():
    # heavy, and build_data (which tests import) needs none of them
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # heavy
    from transformers import PreTrainedTokenizerFast  # heavy

    rng = random.Random(0)
    corpus = []
    for _ in range(2000):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        corpus.append(
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
            f"{question(a, b)} Answer with a number.<|im_end|>\n<|im_start|>assistant\n{a + b}<|im_end|>\n"
        )
    corpus += [
        "The quick brown fox jumps over the lazy dog. Hello world! Reverse the string, sort the list, count the letters."
    ] * 50
    corpus += [
        "<search>capital of France</search> <information>Paris is the capital of France.</information> <answer>Paris</answer>"
    ] * 20
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=512,
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
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.model_max_length = 512
    return hf_tok


def build_model(model_dir, hidden=128, ffn=512, layers=4, seed=0):
    import torch  # heavy: build_data needs none of these
    from transformers import Qwen3Config, Qwen3ForCausalLM  # heavy

    os.makedirs(model_dir, exist_ok=True)
    tok = build_tokenizer()
    tok.save_pretrained(model_dir)
    # transformers 5 writes "TokenizersBackend", which transformers 4 cannot load; this class gives the same ids.
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        tcfg = json.load(f)
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(cfg_path, "w") as f:
        json.dump(tcfg, f, indent=2, sort_keys=True)
    # Pad the vocab to a multiple of 128 so it divides any small TP size (Megatron shards the vocab).
    vocab_size = (len(tok) + 127) // 128 * 128
    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    model.generation_config.eos_token_id = [2, 0]
    model.generation_config.pad_token_id = 0
    model.save_pretrained(model_dir)
    return model_dir


def build_data(data_dir, seed=0):
    """Single-digit addition. The task has only 100 distinct problems, so the splits share problems and differ in
    use: train (500 shuffled lines) is sampled with temperature during RL, eval (each problem once) is scored greedily
    or with eval sampling settings, and sft.jsonl holds chat transcripts for the SFT warm start."""
    os.makedirs(data_dir, exist_ok=True)
    rng = random.Random(seed)
    problems = [(a, b) for a in range(10) for b in range(10)]
    train = problems * 5
    rng.shuffle(train)

    def write(name, rows, make):
        with open(os.path.join(data_dir, name), "w") as f:
            for a, b in rows:
                f.write(json.dumps(make(a, b)) + "\n")

    write(
        "train.jsonl",
        train,
        lambda a, b: {"prompt": [{"role": "user", "content": question(a, b)}], "label": str(a + b)},
    )
    write(
        "eval.jsonl",
        problems,
        lambda a, b: {"prompt": [{"role": "user", "content": question(a, b)}], "label": str(a + b)},
    )
    write(
        "sft.jsonl",
        problems,
        lambda a, b: {
            "messages": [{"role": "user", "content": question(a, b)}, {"role": "assistant", "content": str(a + b)}]
        },
    )
    return data_dir


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default="models/qwen3-tiny")
    p.add_argument("--data-dir", default="data/addition")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--ffn-hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    build_model(a.model_dir, a.hidden_size, a.ffn_hidden_size, a.num_layers, a.seed)
    build_data(a.data_dir, a.seed)
    print(f"tiny kit: model in {a.model_dir}, data in {a.data_dir}")


if __name__ == "__main__":
    main()
