"""Token ids + loss masks for multi-turn chats: train on what the assistant wrote, nothing else."""

from typing import Dict, List, Optional, Tuple


def _template_ids(tokenizer, messages, **kwargs) -> List[int]:
    # transformers 5 returns a BatchEncoding from tokenize=True unless return_dict=False.
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


LOSS_MASK_TYPES = ("qwen", "qwen3", "qwen3_5", "distill_qwen")
_PROBE = {"role": "user", "content": "FOR CALCULATING LOSS MASK ONLY"}


class MultiTurnLossMaskGenerator:
    """`--loss-mask-type`, as current slime defines the types:
    - qwen: each message templated on its own (the template's own system prompt stripped from later turns);
    - qwen3: each message (consecutive tool results together, as Qwen templates wrap them in one user turn)
      templated next to a probe turn, so that it renders as it does inside a conversation (Qwen3 keeps an assistant
      turn's <think> block after the last user turn);
    - qwen3_5: the whole conversation templated once; the characters of each assistant turn (after its header and
      a leading "<think>\n", through <|im_end|> and its newline) are mapped to tokens by their offsets;
    - distill_qwen: the first message as the prompt, the last one's text as the response.
    Every type leaves an assistant turn with `"step_loss_mask": 0` untrained."""

    def __init__(self, tokenizer, tokenizer_type: str = "qwen"):
        if tokenizer_type not in LOSS_MASK_TYPES:
            raise ValueError(
                f"unsupported loss-mask tokenizer type {tokenizer_type!r} (--loss-mask-type): use one of "
                f"{', '.join(LOSS_MASK_TYPES)}"
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

    def _turn_mask(self, message, message_ids) -> List[int]:
        if message["role"] == "assistant" and message.get("step_loss_mask", 1) == 1:
            # 0 on "<|im_start|>assistant\n", 1 on the content, tool calls, <|im_end|> and its newline.
            return [0] * self.gen_token_length + [1] * (len(message_ids) - self.gen_token_length)
        return [0] * len(message_ids)

    def gen_multi_turn_loss_mask_qwen(self, messages: List[Dict], tools: Optional[list] = None):
        all_token_ids, all_loss_masks = [], []
        for i, message in enumerate(messages):
            message_ids = _template_ids(self.tokenizer, [message], **({"tools": tools} if tools and i == 0 else {}))
            if message["role"] != "system" and i > 0:
                message_ids = message_ids[self.system_message_length :]
            all_token_ids.extend(message_ids)
            all_loss_masks.extend(self._turn_mask(message, message_ids))
        return all_token_ids, all_loss_masks

    def gen_multi_turn_loss_mask_qwen3(self, messages: List[Dict], tools: Optional[list] = None):
        probe_ids = _template_ids(self.tokenizer, [_PROBE])
        all_token_ids, all_loss_masks, i = [], [], 0
        while i < len(messages):
            end = i + 1
            while messages[i]["role"] == "tool" and end < len(messages) and messages[end]["role"] == "tool":
                end += 1
            group = messages[i:end]
            if i == 0:  # the probe after it: the conversation's start (system prompt, tools) is this turn's
                ids = _template_ids(self.tokenizer, group + [_PROBE], **({"tools": tools} if tools else {}))
                message_ids = ids[: len(ids) - len(probe_ids)]
            else:  # the probe before it, cut off with whatever the template puts ahead of the first turn
                message_ids = _template_ids(self.tokenizer, [_PROBE] + group)[len(probe_ids) :]
            all_token_ids.extend(message_ids)
            all_loss_masks.extend(self._turn_mask(group[0], message_ids))
            i = end
        return all_token_ids, all_loss_masks

    def gen_multi_turn_loss_mask_qwen3_5(self, messages: List[Dict], tools: Optional[list] = None):
        kwargs = {"tools": tools} if tools else {}
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if enc["input_ids"] != _template_ids(self.tokenizer, messages, **kwargs):
            raise ValueError(
                "--loss-mask-type qwen3_5: tokenizing the rendered conversation does not give the chat template's "
                "own token ids; use --loss-mask-type qwen3 for this tokenizer"
            )
        header, think, end_marker = "<|im_start|>assistant\n", "<think>\n", "<|im_end|>"
        trained = [0] * (len(text) + 1)  # prefix sums of the trained characters
        marks, cursor = [0] * len(text), 0
        for message in messages:
            if message["role"] != "assistant":
                continue
            start = text.find(header, cursor)
            if start < 0:
                raise ValueError("--loss-mask-type qwen3_5: an assistant turn is missing from the rendered template")
            start += len(header)
            stop = text.find(end_marker, start)
            if stop < 0:
                raise ValueError("--loss-mask-type qwen3_5: an assistant turn has no <|im_end|>")
            stop += len(end_marker) + (text[stop + len(end_marker) : stop + len(end_marker) + 1] == "\n")
            cursor = stop
            if message.get("step_loss_mask", 1) == 1:
                first = start + len(think) if text.startswith(think, start) else start
                marks[first:stop] = [1] * (stop - first)
        for k, m in enumerate(marks):
            trained[k + 1] = trained[k] + m
        mask = [int(b > a and trained[b] > trained[a]) for a, b in enc["offset_mapping"]]
        return list(enc["input_ids"]), mask

    def gen_multi_turn_loss_mask_distill_qwen(self, messages: List[Dict]):
        prompt = self.tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
        prompt_tokens = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        response_tokens = self.tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]
        trained = int(messages[-1].get("step_loss_mask", 1) == 1)
        return prompt_tokens + response_tokens, [0] * len(prompt_tokens) + [trained] * len(response_tokens)

    def get_loss_mask(self, messages: List[Dict], tools: Optional[list] = None) -> Tuple[List[int], List[int]]:
        """(token_ids, loss_mask) of `messages`; `tools` go into the template of the conversation's start."""
        if self.tokenizer_type == "distill_qwen" or (
            self.tokenizer_type == "qwen" and "<｜Assistant｜>" in self.tokenizer.get_added_vocab()
        ):
            return self.gen_multi_turn_loss_mask_distill_qwen(messages)
        if self.tokenizer_type == "qwen3":
            return self.gen_multi_turn_loss_mask_qwen3(messages, tools)
        if self.tokenizer_type == "qwen3_5":
            return self.gen_multi_turn_loss_mask_qwen3_5(messages, tools)
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
