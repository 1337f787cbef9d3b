"""Qwen2.5-VL in the trainer: megatron-core's `GPTModel` (multimodal RoPE) as the language model, plus `visual`,
transformers' own vision tower built from the checkpoint's `vision_config`, on the first pipeline stage.

The vision features replace the embeddings at the image- and video-token positions (the `decoder_input`); each
sample's 3-D (temporal, height, width) positions come from transformers' `get_rope_index` on that sample's tokens, per
row of the padded layout or per segment of a packed row. The tower's parameters are named `visual.*`, the
checkpoint's own names, so loading, weight sync and export pass them through unchanged.

Selected by `--hf-checkpoint` (the text config's `model_type`, `arguments.VLM_SPECS`) through current slime's `--spec`
protocol: `get_qwen2_5_vl_model_provider(args, config, vp_stage)` returns the model provider.
"""

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
from megatron.core.models.gpt import GPTModel

from slime.backends.megatron_utils.cp_utils import cp_size_and_rank, local_global_positions
from slime.backends.megatron_utils.model_provider import default_layer_spec, gpt_model_kwargs

# each kind of media a processor outputs: its value in transformers' `mm_token_type_ids`, its pixels, its grids
MEDIA = {"image": (1, "pixel_values", "image_grid_thw"), "video": (2, "pixel_values_videos", "video_grid_thw")}


class _RopeIndex:
    """transformers' `get_rope_index` without building its model: the method reads only the config."""

    def __init__(self, hf_config, hf_model_class=None):
        if hf_model_class is None:
            from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel  # heavy

            hf_model_class = Qwen2_5_VLModel
        self.config = hf_config
        self._get_rope_index = hf_model_class.get_rope_index.__get__(self)
        self.get_vision_position_ids = hf_model_class.get_vision_position_ids.__get__(self)

    def __call__(self, ids, token_types, image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None):
        """[3, len(ids)] positions of one sample's token ids, their media types (0 text, 1 image, 2 video), and its
        images' and videos' grids (and seconds per temporal grid step, Qwen2.5-VL's videos)."""
        positions, _ = self._get_rope_index(
            ids[None],
            token_types.int()[None],
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            second_per_grid_ts=second_per_grid_ts,
        )
        return positions[:, 0]


class RankLocalMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
    """megatron-core's multimodal RoPE for positions that are already this CP rank's own tokens' (the model builds
    them on the whole sequence and keeps its rank's), so not cut to the rank's chunks a second time."""

    def forward(self, position_ids, mrope_section, cp_group=None):
        return super().forward(position_ids, mrope_section)  # its own cp_group is None: no cut


def at_image_tokens(dense, mask, features):
    """`dense` [s, b, h] with `features` written at the image tokens (`mask` [s, b, 1]) in (row, position) order,
    as the processor laid them out."""
    by_row = dense.transpose(0, 1).masked_scatter(mask.transpose(0, 1), features.to(dense.dtype))
    return by_row.transpose(0, 1).contiguous()


class Qwen2_5VLModel(GPTModel):
    """`GPTModel` with `position_embedding_type="mrope"` that also takes the processor's image and video outputs
    (`pixel_values` / `image_grid_thw`, `pixel_values_videos` / `video_grid_thw` / `second_per_grid_ts`),
    concatenated over the micro-batch's samples in order."""

    # a video's tokens: one run of video-pad ids (Qwen2.5-VL), or one run per temporal grid step, each after a
    # <|vision_start|> of its own and a timestamp (Qwen3-VL, Qwen3.5)
    video_run_per_frame = False

    @staticmethod
    def hf_classes(hf_config):
        """(transformers' model class whose `get_rope_index` this family uses, its vision tower class)"""
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m  # heavy

        return m.Qwen2_5_VLModel, m.Qwen2_5_VisionTransformerPretrainedModel

    def __init__(self, hf_config, **kwargs):
        # 3-D positions whatever the flags say (current slime's -vl scripts pass --position-embedding-type rope)
        kwargs["config"].mrope_section = list(hf_config.text_config.rope_parameters["mrope_section"])
        super().__init__(**{**kwargs, "position_embedding_type": "mrope"})
        self.pad_ids = {"image": hf_config.image_token_id, "video": hf_config.video_token_id}
        self.vision_start_token_id = hf_config.vision_start_token_id
        self.merge = hf_config.vision_config.spatial_merge_size
        hf_model, tower = self.hf_classes(hf_config)
        self.rope_index = _RopeIndex(hf_config, hf_model)
        self.rotary_pos_emb.__class__ = RankLocalMultimodalRotaryEmbedding
        self.rotary_pos_emb.cp_group = None  # positions come per CP rank (`_whole_sequence`)
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
        pixel_values_videos=None,
        video_grid_thw=None,
        second_per_grid_ts=None,
        rows_per_sample=None,
        tree_samples=None,
        **kwargs,
    ):
        # under CP the media and 3-D positions are found on the whole sequence, then cut to this rank's tokens
        ids, local = self._whole_sequence(input_ids, packed_seq_params)
        if tree_samples is not None:  # --tree-training: a prefix-tree row
            token_types, positions, media = self._tree_media_and_positions(ids, tree_samples)
        else:
            media = {
                "pixel_values": pixel_values,
                "image_grid_thw": image_grid_thw,
                "pixel_values_videos": pixel_values_videos,
                "video_grid_thw": video_grid_thw,
                "second_per_grid_ts": second_per_grid_ts,
                "rows_per_sample": rows_per_sample,
            }
            token_types, positions, _ = self._media_tokens_and_positions(ids, packed_seq_params, media)
        if self.pre_process and decoder_input is None:
            decoder_input = self._embed_with_media(ids, token_types, media, local)
        if local is not None:
            positions = positions[:, :, local]
        return super().forward(
            input_ids,
            positions,
            attention_mask,
            decoder_input=decoder_input,
            labels=labels,
            packed_seq_params=packed_seq_params,
            **kwargs,
        )

    def _whole_sequence(self, input_ids, packed_seq_params):
        """(the whole sequence's ids [b, s] under context parallelism, gathered from every CP rank's zigzag chunks,
        and this rank's positions in it; `input_ids` and None without CP)."""
        cp_size, cp_rank = cp_size_and_rank()
        if cp_size == 1:
            return input_ids, None
        global_cu = packed_seq_params.cu_seqlens_q if packed_seq_params is not None else None
        index, total = local_global_positions(input_ids.size(1), cp_size, cp_rank, global_cu)
        index = index.to(input_ids.device)
        ids = input_ids.new_zeros(input_ids.size(0), total).index_copy(1, index, input_ids)
        dist.all_reduce(ids, group=mpu.get_context_parallel_group())
        return ids, index

    def _segments(self, input_ids, packed_seq_params):
        """(row, start, end) of each sample: whole rows (padded layout), or the packed row's `cu_seqlens` runs."""
        if packed_seq_params is None:
            return [(b, 0, input_ids.size(1)) for b in range(input_ids.size(0))]
        cu = packed_seq_params.cu_seqlens_q.tolist()
        return [(0, lo, hi) for lo, hi in zip(cu[:-1], cu[1:]) if hi > lo]

    def _runs(self, kind, grids):
        """[(item, token count)] of the pad runs `grids` (one per image or video, in order) should find."""
        if grids is None:
            return []
        if kind == "video" and self.video_run_per_frame:
            return [(i, h * w // self.merge**2) for i, (t, h, w) in enumerate(grids.tolist()) for _ in range(t)]
        return [(i, n) for i, n in enumerate((grids.prod(-1) // self.merge**2).tolist())]

    def _samples(self, segments, media):
        """[(name, segments, {kind: runs [(item, token count)]})] per sample: each segment (row or packed run) with
        its own images' and videos' runs where `media["rows_per_sample"]` ({grids key: each sample's count}, as
        `get_batch` passes it) says how many each sample brought, else all segments with all of `media`'s."""
        runs = {kind: self._runs(kind, media.get(grids)) for kind, (_, _, grids) in MEDIA.items()}
        counts = media.get("rows_per_sample")
        if counts is None:
            return [("the micro-batch", segments, runs)]
        samples, first = [], dict.fromkeys(MEDIA, 0)
        for i, segment in enumerate(segments):  # the padding of a packed row: a segment of no sample, no media
            mine = {}
            for kind, (_, _, grids) in MEDIA.items():
                n = counts.get(grids, [])
                last = first[kind] + (n[i] if i < len(n) else 0)
                mine[kind] = [run for run in runs[kind] if first[kind] <= run[0] < last]
                first[kind] = last
            samples.append((f"sample {i} of the micro-batch", [segment], mine))
        return samples

    def _media_tokens_and_positions(self, input_ids, packed_seq_params, media):
        """([b, s] media type of each token (0 text, 1 image, 2 video), [3, b, s] positions, {kind: [(row, index)
        of each item's first token]}). A sample's images' and videos' tokens are, in order, the runs of their pad
        ids right after a <|vision_start|>, each as long as the next of its items' feature count (per frame for
        Qwen3's videos), as the processor lays them out; any other pad id is one the model generated, text to the
        engine and here, as is a run past the sample's items. Fails in one line, naming the sample, unless each of a
        sample's images and videos finds its runs (`_samples`)."""
        kind_of = {pad: kind for kind, pad in self.pad_ids.items()}
        token_types = torch.zeros_like(input_ids)
        positions = torch.zeros(3, *input_ids.shape, dtype=torch.long, device=input_ids.device)
        starts = {kind: [] for kind in MEDIA}
        for name, segments, runs in self._samples(self._segments(input_ids, packed_seq_params), media):
            used = dict.fromkeys(MEDIA, 0)
            for row, lo, hi in segments:
                ids, first = input_ids[row, lo:hi].tolist(), dict(used)
                for start in (i + 1 for i, t in enumerate(ids[:-1]) if t == self.vision_start_token_id):
                    kind = kind_of.get(ids[start])
                    if kind is None:
                        continue
                    end = start
                    while end < len(ids) and ids[end] == self.pad_ids[kind]:
                        end += 1
                    k, todo = used[kind], runs[kind]
                    if k < len(todo) and end - start == todo[k][1] > 0:
                        token_types[row, lo + start : lo + end] = MEDIA[kind][0]
                        if k == 0 or todo[k - 1][0] != todo[k][0]:
                            starts[kind].append((row, lo + start))
                        used[kind] += 1
                mine = {}
                for kind, (_, _, grids) in MEDIA.items():
                    items = sorted({item for item, _ in runs[kind][first[kind] : used[kind]]})
                    mine[kind] = media[grids][items] if items else None
                    if kind == "video" and items and media.get("second_per_grid_ts") is not None:
                        mine["seconds"] = media["second_per_grid_ts"][items]
                positions[:, row, lo:hi] = self.rope_index(
                    input_ids[row, lo:hi], token_types[row, lo:hi], mine["image"], mine["video"], mine.get("seconds")
                )
            for kind, todo in runs.items():
                if used[kind] != len(todo):
                    items = len({item for item, _ in todo})
                    found = todo[used[kind]][0] - todo[0][0]  # the sample's items before the first run not found
                    raise ValueError(
                        f"{name} has {items} {kind}s in multimodal_train_inputs but its tokens hold the "
                        f"{kind}-token runs (id {self.pad_ids[kind]}, each after <|vision_start|>, as long as its "
                        f"{kind}'s features{' per frame' if kind == 'video' and self.video_run_per_frame else ''}) of "
                        f"{found}: multimodal_train_inputs do not match the tokens"
                    )
        return token_types, positions, starts

    def _tree_media_and_positions(self, input_ids, tree_samples):
        """A prefix-tree row ([1, n]) of samples `tree_samples` [(layout indices, processor outputs or None)]: each
        sample's media runs and 3-D positions found on its own tokens and written at its nodes (equal on shared
        nodes, whose tokens and media are the same); an image or video on nodes several samples share is encoded
        once. Returns (token types, positions, the row's media in its order)."""
        token_types = torch.zeros_like(input_ids)
        positions = torch.zeros(3, *input_ids.shape, dtype=torch.long, device=input_ids.device)
        found = {kind: {} for kind in MEDIA}  # kind -> layout index of an item's first token -> (its pixels, grid)
        for index, mm in tree_samples:
            index = index.to(input_ids.device)
            types, pos, starts = self._media_tokens_and_positions(input_ids[:, index], None, mm or {})
            positions[:, :, index] = pos
            token_types[0, index] = torch.maximum(token_types[0, index], types[0])
            for kind, (_, pixels, grids) in MEDIA.items():
                if starts[kind]:
                    split = mm[pixels].split(mm[grids].prod(-1).tolist())
                    for (_, start), pix, grid in zip(starts[kind], split, mm[grids]):
                        found[kind].setdefault(int(index[start]), (pix, grid))
        media = {}
        for kind, (_, pixels, grids) in MEDIA.items():
            order = sorted(found[kind])
            if order:
                media[pixels] = torch.cat([found[kind][n][0] for n in order])
                media[grids] = torch.stack([found[kind][n][1] for n in order])
        return token_types, positions, media

    def _embed_with_media(self, input_ids, token_types, media, local=None):
        """Word embeddings [s, b, h] with the vision features of the images and videos written at their tokens, cut
        to this CP rank's positions `local` (None: all) and scattered over the sequence with --sequence-parallel."""
        embeddings = self.embedding(input_ids=input_ids, position_ids=None)
        parts = []  # (mask [s, b, 1], the tower's output) per kind present: transformers encodes each kind apart
        for type_id, pixels, grids in MEDIA.values():
            if media.get(pixels) is not None:
                vision = self.visual(media[pixels].to(self.visual.dtype), grid_thw=media[grids])
                parts.append(((token_types == type_id).t()[..., None], vision))
        if parts:
            embeddings = self._with_vision(embeddings, parts, local)
        return self._to_rank(embeddings, local)

    def _with_vision(self, embeddings, parts, local=None):
        for mask, vision in parts:
            embeddings = at_image_tokens(embeddings, mask, vision.pooler_output)
        return embeddings

    def _to_rank(self, x, local):
        """`x` [s, b, h] over the whole sequence as this rank holds it: its CP positions, its sequence-parallel
        part. The tower runs on every CP rank; each keeps the gradient of its own positions' features, and the
        gradient reduction over data and context parallel ranks adds them up."""
        if local is not None:
            x = x.index_select(0, local)
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
