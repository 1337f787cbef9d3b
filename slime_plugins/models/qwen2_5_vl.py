"""Qwen2.5-VL in the trainer: megatron-core's `GPTModel` (multimodal RoPE) as the language model, plus `visual`,
transformers' own vision tower built from the checkpoint's `vision_config`, on the first pipeline stage.

The vision features replace the embeddings at the image-token positions (the `decoder_input`); each sample's 3-D
(temporal, height, width) positions come from transformers' `get_rope_index` on that sample's tokens, per row of the
padded layout or per segment of a packed row. The tower's parameters are named `visual.*`, the checkpoint's own
names, so loading, weight sync and export pass them through unchanged.

Selected by `--hf-checkpoint` (the text config's `model_type`, `arguments.VLM_SPECS`) through current slime's `--spec`
protocol: `get_qwen2_5_vl_model_provider(args, config, vp_stage)` returns the model provider.
"""

import torch
from megatron.core.models.gpt import GPTModel

from slime.backends.megatron_utils.model_provider import default_layer_spec, gpt_model_kwargs


class _RopeIndex:
    """transformers' `get_rope_index` without building its model: the method reads only the config."""

    def __init__(self, hf_config, hf_model_class=None):
        if hf_model_class is None:
            from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel  # heavy

            hf_model_class = Qwen2_5_VLModel
        self.config = hf_config
        self._get_rope_index = hf_model_class.get_rope_index.__get__(self)
        self.get_vision_position_ids = hf_model_class.get_vision_position_ids.__get__(self)

    def __call__(self, ids, is_image, image_grid_thw):
        """[3, len(ids)] positions of one sample's token ids, which of them are image tokens, and its images' grids."""
        positions, _ = self._get_rope_index(ids[None], is_image.int()[None], image_grid_thw=image_grid_thw)
        return positions[:, 0]


def at_image_tokens(dense, mask, features):
    """`dense` [s, b, h] with `features` written at the image tokens (`mask` [s, b, 1]) in (row, position) order,
    as the processor laid them out."""
    by_row = dense.transpose(0, 1).masked_scatter(mask.transpose(0, 1), features.to(dense.dtype))
    return by_row.transpose(0, 1).contiguous()


class Qwen2_5VLModel(GPTModel):
    """`GPTModel` with `position_embedding_type="mrope"` that also takes `pixel_values` / `image_grid_thw` (the
    processor's outputs, concatenated over the micro-batch's samples in order)."""

    @staticmethod
    def hf_classes(hf_config):
        """(transformers' model class whose `get_rope_index` this family uses, its vision tower class)"""
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m  # heavy

        return m.Qwen2_5_VLModel, m.Qwen2_5_VisionTransformerPretrainedModel

    def __init__(self, hf_config, **kwargs):
        # 3-D positions whatever the flags say (current slime's -vl scripts pass --position-embedding-type rope)
        kwargs["config"].mrope_section = list(hf_config.text_config.rope_parameters["mrope_section"])
        super().__init__(**{**kwargs, "position_embedding_type": "mrope"})
        self.image_token_id = hf_config.image_token_id
        self.vision_start_token_id = hf_config.vision_start_token_id
        self.merge = hf_config.vision_config.spatial_merge_size
        hf_model, tower = self.hf_classes(hf_config)
        self.rope_index = _RopeIndex(hf_config, hf_model)
        if self.pre_process:
            vision_config = hf_config.vision_config
            vision_config._attn_implementation = "sdpa"
            self.visual = tower._from_config(vision_config, dtype=self.config.params_dtype)
            for p in self.visual.parameters():  # replicated on every TP rank, gathered by no one
                p.tensor_model_parallel = False
            # the embeddings are scattered over the sequence (--sequence-parallel) only once the image features are
            # written over them, at their positions in the whole sequence
            self.embedding.scatter_to_sequence_parallel = False
            self.embedding.reduce_scatter_embeddings = False
            self.embedding.word_embeddings.reduce_scatter_embeddings = False

    def forward(
        self,
        input_ids,
        position_ids,
        attention_mask,
        decoder_input=None,
        labels=None,
        packed_seq_params=None,
        pixel_values=None,
        image_grid_thw=None,
        tree_samples=None,
        **kwargs,
    ):
        if tree_samples is not None:  # --tree-training: a prefix-tree row
            is_image, positions, pixel_values, image_grid_thw = self._tree_images_and_positions(
                input_ids, tree_samples
            )
        else:
            is_image, positions = self._image_tokens_and_positions(input_ids, packed_seq_params, image_grid_thw)
        if self.pre_process and decoder_input is None:
            decoder_input = self._embed_with_images(input_ids, is_image, pixel_values, image_grid_thw)
        return super().forward(
            input_ids,
            positions,
            attention_mask,
            decoder_input=decoder_input,
            labels=labels,
            packed_seq_params=packed_seq_params,
            **kwargs,
        )

    def _segments(self, input_ids, packed_seq_params):
        """(row, start, end) of each sample: whole rows (padded layout), or the packed row's `cu_seqlens` runs."""
        if packed_seq_params is None:
            return [(b, 0, input_ids.size(1)) for b in range(input_ids.size(0))]
        cu = packed_seq_params.cu_seqlens_q.tolist()
        return [(0, lo, hi) for lo, hi in zip(cu[:-1], cu[1:]) if hi > lo]

    def _image_tokens_and_positions(self, input_ids, packed_seq_params, image_grid_thw):
        """([b, s] bool: the image tokens, [3, b, s] positions). The images' tokens are, in order, the runs of
        image-pad ids right after a <|vision_start|> that are as long as the next image's feature count (as the
        processor lays them out); any other image-pad id is one the model generated, text to the engine and here.
        Fails in one line unless every image of `image_grid_thw` finds its run."""
        grids = image_grid_thw if image_grid_thw is not None else input_ids.new_zeros(0, 3)
        per_image = (grids.prod(-1) // self.merge**2).tolist()
        is_image = torch.zeros_like(input_ids, dtype=torch.bool)
        positions = torch.zeros(3, *input_ids.shape, dtype=torch.long, device=input_ids.device)
        used = 0
        for row, lo, hi in self._segments(input_ids, packed_seq_params):
            ids, first = input_ids[row, lo:hi].tolist(), used
            for start in (i + 1 for i, t in enumerate(ids) if t == self.vision_start_token_id):
                end = start
                while end < len(ids) and ids[end] == self.image_token_id:
                    end += 1
                if used < len(per_image) and end - start == per_image[used] > 0:
                    is_image[row, lo + start : lo + end] = True
                    used += 1
            images = grids[first:used] if used > first else None
            positions[:, row, lo:hi] = self.rope_index(input_ids[row, lo:hi], is_image[row, lo:hi], images)
        if used != len(per_image):
            raise ValueError(
                f"the micro-batch has {len(per_image)} images in multimodal_train_inputs but its tokens hold the "
                f"image-token runs (id {self.image_token_id}, each after <|vision_start|>, as long as its image's "
                f"features) of {used}: multimodal_train_inputs do not match the tokens"
            )
        return is_image, positions

    def _tree_images_and_positions(self, input_ids, tree_samples):
        """A prefix-tree row ([1, n]) of samples `tree_samples` [(layout indices, processor outputs or None)]: each
        sample's image runs and 3-D positions found on its own tokens and written at its nodes (equal on shared
        nodes, whose tokens and images are the same); an image on nodes several samples share is encoded once.
        Returns (is_image, positions, pixel_values, image_grid_thw), the images in the row's order."""
        is_image = torch.zeros_like(input_ids, dtype=torch.bool)
        positions = torch.zeros(3, *input_ids.shape, dtype=torch.long, device=input_ids.device)
        images = {}  # layout index of an image run's first token -> (its pixel rows, its grid)
        for index, mm in tree_samples:
            index = index.to(input_ids.device)
            grids = None if mm is None else mm["image_grid_thw"]
            mine, pos = self._image_tokens_and_positions(input_ids[:, index], None, grids)
            positions[:, :, index], mine = pos, mine[0]
            is_image[0, index] |= mine
            if mm is not None:
                starts = (mine & ~torch.cat([mine.new_zeros(1), mine[:-1]])).nonzero()[:, 0].tolist()
                pixels = mm["pixel_values"].split(grids.prod(-1).tolist())
                for start, pix, grid in zip(starts, pixels, grids):
                    images.setdefault(int(index[start]), (pix, grid))
        if not images:
            return is_image, positions, None, None
        order = sorted(images)
        pixel_values = torch.cat([images[n][0] for n in order])
        return is_image, positions, pixel_values, torch.stack([images[n][1] for n in order])

    def _embed_with_images(self, input_ids, is_image, pixel_values, image_grid_thw):
        """Word embeddings [s, b, h] with the vision features written at the image tokens (scattered over the
        sequence with --sequence-parallel)."""
        embeddings = self.embedding(input_ids=input_ids, position_ids=None)
        if pixel_values is not None:
            vision = self.visual(pixel_values.to(self.visual.dtype), grid_thw=image_grid_thw)
            mask = is_image.t()[..., None]  # [s, b, 1], like the embeddings
            embeddings = self._with_vision(embeddings, mask, vision)
        return self._to_sequence_parallel(embeddings)

    def _with_vision(self, embeddings, mask, vision):
        return at_image_tokens(embeddings, mask, vision.pooler_output)

    def _to_sequence_parallel(self, x):
        if not self.config.sequence_parallel:
            return x
        from megatron.core import tensor_parallel

        return tensor_parallel.scatter_to_sequence_parallel_region(x)


def vlm_model_provider(model_class, args, config, layer_spec_fn=default_layer_spec):
    """A model provider building `model_class` for `--hf-checkpoint`'s config, its decoder layers from
    `layer_spec_fn(args, config, vp_stage)`."""
    from transformers import AutoConfig  # heavy

    hf_config = AutoConfig.from_pretrained(args.hf_checkpoint, trust_remote_code=True)

    def provider(pre_process=True, post_process=True, vp_stage=None):
        layer_spec = layer_spec_fn(args, config, vp_stage)
        return model_class(
            hf_config, **gpt_model_kwargs(args, config, layer_spec, pre_process, post_process, vp_stage)
        )

    return provider


def get_qwen2_5_vl_model_provider(args, config, vp_stage=None):
    """Current slime's `--spec` protocol: a model provider for `--hf-checkpoint`'s Qwen2.5-VL."""
    return vlm_model_provider(Qwen2_5VLModel, args, config)
