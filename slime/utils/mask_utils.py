"""Token ids + loss masks for multi-turn chats: train on what the assistant wrote, nothing else."""

from typing import Dict, List, Optional, Tuple


def _template_ids(tokenizer, messages, **kwargs) -> List[int]:
    # transformers 5 returns a BatchEncoding from tokenize=True unless return_dict=False.
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


class MultiTurnLossMaskGenerator:
    def __init__(self, tokenizer, tokenizer_type: str = "qwen"):
        if tokenizer_type not in ("qwen", "distill_qwen"):
            raise ValueError(
                f"unsupported loss-mask tokenizer type {tokenizer_type!r} (--loss-mask-type): use qwen or distill_qwen"
            )
        self.tokenizer = tokenizer
        self.tokenizer_type = tokenizer_type
        self.system_message_length, self.gen_token_length = self.get_system_message_length()

    @staticmethod
    def find_all_sublist_indices(main_list, sublist):
        n = len(sublist)
        return [i for i in range(len(main_list) - n + 1) if main_list[i : i + n] == sublist]

    def get_system_message_length(self) -> Tuple[int, int]:
        """(tokens of the system block the template adds on its own, tokens of the generation prompt).

        Templating two identical user turns and locating the raw text in both gives the per-turn wrapper size;
        whatever precedes the first turn beyond that is the auto-inserted system prompt (Qwen2.5 has one)."""
        text = "FOR TESTING ONLY"
        messages = [{"role": "user", "content": text}, {"role": "user", "content": text}]
        raw = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = _template_ids(self.tokenizer, messages)
        found = self.find_all_sublist_indices(ids, raw)
        if len(found) != 2:
            raise ValueError(
                "cannot measure the chat template: the probe text was not found exactly twice "
                f"(found {len(found)}); is this a chat model's tokenizer?"
            )
        idx_1, idx_2 = found
        end_interval = len(ids) - len(raw) - idx_2
        gen_token_length = len(_template_ids(self.tokenizer, messages, add_generation_prompt=True)) - len(ids)
        system_message_length = idx_1 - ((idx_2 - idx_1) - end_interval - len(raw))
        return system_message_length, gen_token_length

    def gen_multi_turn_loss_mask_qwen(self, messages: List[Dict], tools: Optional[list] = None):
        all_token_ids, all_loss_masks = [], []
        for i, message in enumerate(messages):
            message_ids = _template_ids(self.tokenizer, [message], **({"tools": tools} if tools and i == 0 else {}))
            if message["role"] != "system" and i > 0:
                message_ids = message_ids[self.system_message_length :]
            if message["role"] == "assistant":
                # 0 on "<|im_start|>assistant\n", 1 on the content, tool calls, <|im_end|> and its newline.
                loss_mask = [0] * self.gen_token_length + [1] * (len(message_ids) - self.gen_token_length)
            else:
                loss_mask = [0] * len(message_ids)
            all_token_ids.extend(message_ids)
            all_loss_masks.extend(loss_mask)
        return all_token_ids, all_loss_masks

    def gen_multi_turn_loss_mask_distill_qwen(self, messages: List[Dict]):
        prompt = self.tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
        prompt_tokens = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        response_tokens = self.tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]
        return prompt_tokens + response_tokens, [0] * len(prompt_tokens) + [1] * len(response_tokens)

    def get_loss_mask(self, messages: List[Dict], tools: Optional[list] = None) -> Tuple[List[int], List[int]]:
        """(token_ids, loss_mask) of `messages`; `tools` (qwen type) goes into the first message's template."""
        if self.tokenizer_type == "distill_qwen" or "<｜Assistant｜>" in self.tokenizer.get_added_vocab():
            return self.gen_multi_turn_loss_mask_distill_qwen(messages)
        return self.gen_multi_turn_loss_mask_qwen(messages, tools)

    def get_response_lengths(self, loss_masks: List[List[int]]) -> List[int]:
        """Per mask: tokens from the first 1 to the end (the response part of prompt+response), or 0."""
        return [len(mask) - list(mask).index(1) if 1 in mask else 0 for mask in loss_masks]

    def get_text_from_loss_mask(self, token_ids: List[int], loss_masks: List[int]) -> List[str]:
        """Decoded text of each contiguous run of mask-1 tokens."""
        texts, current = [], []
        for token, mask in zip(token_ids, loss_masks):
            if mask == 1:
                current.append(token)
            elif current:
                texts.append(self.tokenizer.decode(current))
                current = []
        if current:
            texts.append(self.tokenizer.decode(current))
        return texts
