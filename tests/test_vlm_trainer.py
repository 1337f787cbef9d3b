"""Training Qwen2.5-VL, Qwen3-VL and Qwen3.5 on images, on the tiny offline kits (tools/build_tiny_vlm.py).

`--hf-checkpoint` alone builds the model (megatron-core's `GPTModel` with multimodal RoPE plus transformers' vision
tower, `slime_plugins/models/qwen2_5_vl.py`); samples carry the processor's outputs (`multimodal_train_inputs`)
through the train-data conversion, the DP split and the micro-batches. The trainer's log-probs equal transformers'
Qwen2.5-VL forward of the same images; a training step moves every vision-tower weight, and
`--freeze-params-name-list visual` keeps them all.
"""

import os
import types

import numpy as np
import pytest
import torch

from slime.config import parse_args
from tests._megatron_helpers import read_checkpoint, spawn

TEXT = "<|im_start|>user\n{images}What colour is the shape?<|im_end|>\n<|im_start|>assistant\n"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# per sample: image sizes (w, h) in pixels (14-px patches merged 2x2: 28x28 -> 1 token, 56x84 -> 6), reward
SAMPLES = [([(28, 28)], 1.0), ([(84, 56), (28, 56)], 0.0), ([], 0.0), ([(56, 56)], 1.0)]
RL = [
    "--lr",
    "1",
    "--adam-eps",
    "1",  # Adam's first step is then g / (|g| + 1) (not sign(g)): layouts compare gradients through the weights
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "2",
    "--global-batch-size",
    "4",
    "--micro-batch-size",
    "2",  # [1 image, 2 images of other sizes] and [text only, 1 image]: padded rows of different lengths
    "--num-rollout",
    "1",
    "--rollout-num-gpus",
    "1",
    "--seq-length",
    "128",
    "--actor-num-gpus-per-node",
    "1",
    "--debug-train-only",
    "--multimodal-keys",
    '{"image": "images"}',
    "--weight-decay",
    "0",  # a weight moves exactly when its gradient is not zero
]


def vlm_args(hf_dir, *extra):
    return parse_args(argv=[*RL, "--hf-checkpoint", hf_dir, *extra])


def _image(size, seed):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def make_samples(hf_dir):
    """Samples as the default rollout leaves them: expanded prompt ids + a response, the processor's other outputs,
    the images themselves."""
    from slime.utils.processing_utils import load_processor, process_prompt
    from slime.utils.types import Sample

    processor = load_processor(hf_dir)
    rng = np.random.default_rng(0)
    samples = []
    for i, (sizes, reward) in enumerate(SAMPLES):
        images = [_image(s, 10 * i + j) for j, s in enumerate(sizes)]
        ids, train_inputs = process_prompt(processor, TEXT.format(images=IMAGE * len(images)), images)
        response = rng.integers(10, 300, 4 + i).tolist()  # plain text ids (the special ones are 0..6)
        samples.append(
            Sample(
                index=i,
                tokens=ids + response,
                response_length=len(response),
                reward=reward,
                multimodal_train_inputs=train_inputs if images else None,
                multimodal_inputs={"images": images} if images else None,
            )
        )
    return samples


def video_prompt(hf_dir, frames, height, width):
    """(the prompt ids of one video of `frames` frames of `height` x `width` px, as transformers' processor of the
    family lays them out, random pixel rows, video_grid_thw) for the tiny kit at `hf_dir`. The processor itself
    needs torchvision; the layouts are the ones its Qwen2.5-VL and Qwen3-VL processors print: one pad run per video
    after <|vision_start|> (Qwen2.5-VL), or per temporal step, each behind its timestamp and a <|vision_start|> of its
    own, inside the video's <|vision_start|> ... <|vision_end|> (Qwen3-VL, Qwen3.5)."""
    from transformers import AutoConfig, AutoTokenizer

    cfg, tok = AutoConfig.from_pretrained(hf_dir), AutoTokenizer.from_pretrained(hf_dir)
    vision = cfg.vision_config
    patch, merge, step = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
    grid = [frames // step, height // patch, width // patch]
    per_step = grid[1] * grid[2] // merge**2
    pad = "<|video_pad|>"
    if cfg.model_type == "qwen2_5_vl":
        inner = pad * (grid[0] * per_step)
    else:
        inner = "".join(
            f"<{t + 0.5:.1f} seconds><|vision_start|>{pad * per_step}<|vision_end|>" for t in range(grid[0])
        )
    ids = tok(f"<|vision_start|>{inner}<|vision_end|>", add_special_tokens=False)["input_ids"]
    rows = grid[0] * grid[1] * grid[2]
    pixels = torch.randn(rows, 3 * step * patch * patch, generator=torch.Generator().manual_seed(rows))
    return ids, pixels, torch.tensor([grid])


def make_video_samples(hf_dir):
    """Samples with videos: one video (2 temporal steps); an image and then a video of another size (Qwen2.5-VL: with
    its seconds per temporal step); text only; a 3-step video."""
    from transformers import AutoConfig

    from slime.utils.processing_utils import load_processor, process_prompt
    from slime.utils.types import Sample

    qwen2_5 = AutoConfig.from_pretrained(hf_dir).model_type == "qwen2_5_vl"
    processor = load_processor(hf_dir)
    head, tail = (processor.tokenizer(part, add_special_tokens=False)["input_ids"] for part in TEXT.split("{images}"))
    rng = np.random.default_rng(1)
    samples = []
    for i, (image, videos) in enumerate(
        [(None, [(4, 64, 64)]), ((56, 28), [(4, 32, 96)]), (None, []), (None, [(6, 32, 32)])]
    ):
        ids, mm = list(head), {}
        if image:
            image_ids, mm = process_prompt(processor, IMAGE, [_image(image, i)])
            ids += image_ids
            mm.pop("mm_token_type_ids")
        for frames, h, w in videos:
            video_ids, pixels, grid = video_prompt(hf_dir, frames, h, w)
            ids += video_ids
            mm.update(pixel_values_videos=pixels, video_grid_thw=grid)
            if qwen2_5:
                mm["second_per_grid_ts"] = torch.tensor([0.5 + i])
        response = rng.integers(10, 300, 3 + i).tolist()
        samples.append(
            Sample(
                index=i,
                tokens=ids + tail + response,
                response_length=len(response),
                reward=float(i % 2),
                multimodal_train_inputs=mm or None,
            )
        )
    return samples


def hf_vlm_log_probs(hf_dir, samples):
    """Each sample's response log-probs from transformers' Qwen2.5-VL, fp32, one sample at a time."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor(s.tokens)[None]
            inputs = dict(s.multimodal_train_inputs or {})
            inputs["mm_token_type_ids"] = (ids == model.config.image_token_id) + 2 * (
                ids == model.config.video_token_id
            )
            logits = model(input_ids=ids, **inputs).logits[0].float()
            r = s.response_length
            out.append(torch.log_softmax(logits[-r - 1 : -1], -1).gather(1, ids[0, -r:, None])[:, 0])
    return out


def _export(args, model):
    """The model's weights under HF names, as --save-hf writes them (collective over TP and EP; with --enable-lora
    the adapters merged into their base weights, as `--lora-sync merged` sends them)."""
    from slime.backends.megatron_utils.lora import merge_for_sync
    from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf, get_family
    from slime.backends.megatron_utils.megatron_to_hf._common import CheckpointLayout
    from slime.backends.megatron_utils.param_utils import (
        all_gather_param,
        expert_parallel_copies,
        named_parameters,
        remove_padding,
    )
    from slime.backends.megatron_utils.update_weight.common import is_tied_output_copy

    exported, layout = {}, CheckpointLayout(get_family(args.model_name), args.num_experts)
    for name, param in merge_for_sync(args, named_parameters(args, model)):
        if is_tied_output_copy(args, name):  # the last stage's copy of the tied embedding: not sent
            continue
        for n, p in expert_parallel_copies(args, name, param):  # every EP rank's experts
            full = remove_padding(n, all_gather_param(n, p), args.vocab_size)
            for k, v in convert_to_hf(args, args.model_name, n, full):
                exported.update((h, t.clone()) for h, t in layout.add(k, v))
    layout.close()
    return exported


def _train_step(rank, hf_dir, samples, tp, pp, freeze, out, extra=(), cp=1, dp=1):
    """Build the trainer from --hf-checkpoint, check its log-probs against transformers (on the last pipeline stage),
    train one GRPO step and report which weights moved and their values after the step (each pipeline stage its
    own, merged by `train_once`)."""
    import warnings

    warnings.filterwarnings("ignore")
    import ray
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.model import forward_only, initialize_model_and_optimizer, train
    from slime.backends.megatron_utils.param_utils import PREFIX, named_parameters
    from slime.backends.megatron_utils.rollout_data import process_rollout_data
    from slime.rollout.train_data import convert_samples_to_train_data

    class _Ref:
        def __init__(self, data):
            self.inner = data

    ray.get = lambda x: x  # the test hands the dict itself instead of an ObjectRef
    layout = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    layout += ["--context-parallel-size", str(cp), "--actor-num-gpus-per-node", str(tp * pp * cp * dp)]
    if pp > 1:  # every layer but the last on the first stage, with the tower (Qwen3-VL's DeepStack layers)
        from transformers import AutoConfig

        layers = AutoConfig.from_pretrained(hf_dir).text_config.num_hidden_layers
        layout += ["--decoder-first-pipeline-num-layers", str(layers - 1)]
    args = vlm_args(hf_dir, *layout, *(["--freeze-params-name-list", "visual"] if freeze else []), *extra)
    init(args)
    model, opt, sched, _ = initialize_model_and_optimizer(args)
    data = convert_samples_to_train_data(args, samples)
    rollout = process_rollout_data(args, _Ref(data), mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())
    iters, nmb = get_data_iterator(args, model, rollout)
    last_stage = mpu.is_pipeline_last_stage()
    log_probs = forward_only(args, model, iters, nmb).get("log_probs")
    diff = None
    if last_stage:
        ref = hf_vlm_log_probs(hf_dir, [samples[i] for i in rollout["global_indices"]])
        diff = max((g - e).abs().max().item() for g, e in zip(log_probs, ref))
        assert diff <= 1e-5, f"tp{tp} pp{pp} cp{cp}: max |trainer - transformers| log-prob = {diff}"

    # export (weight sync, --save-hf) gives back the checkpoint bit for bit, the tower under its own names (each
    # pipeline stage its part: the tower on the first)
    exported, expected = _export(args, model), read_checkpoint(hf_dir)
    assert set(exported) <= set(expected), set(exported) - set(expected)
    assert all(torch.equal(exported[k], v) for k, v in exported.items() for v in [expected[k]])
    assert any("visual." in k for k in exported) == mpu.is_pipeline_first_stage()

    before = {n[len(PREFIX) :]: p.detach().clone() for n, p in named_parameters(args, model)}
    rollout.update(forward_only(args, model, iters, nmb, store_prefix="ref_"))
    rollout.update(forward_only(args, model, iters, nmb))
    compute_advantages_and_returns(args, rollout)
    train(args, 0, model, opt, sched, iters, nmb)
    moved = {n[len(PREFIX) :]: p.detach() for n, p in named_parameters(args, model)}
    moved = {n: not torch.equal(before[n], p) for n, p in moved.items()}
    after = _export(args, model)
    if mpu.get_tensor_model_parallel_rank() == mpu.get_data_parallel_rank() == mpu.get_context_parallel_rank() == 0:
        stage = mpu.get_pipeline_model_parallel_rank()
        torch.save({"diff": diff, "moved": moved, "after": after, "exported": set(exported)}, f"{out}.{stage}")


_RESULTS = {}


def train_once(hf_dir, samples, tp, freeze, tmp_dir, pp=1, extra=(), name="images", cp=1, dp=1):
    """`_train_step`'s result for one layout (and `extra` flags) on the samples called `name`, run once per test
    session, its pipeline stages' parts merged."""
    key = (hf_dir, name, tp, pp, cp, dp, freeze, tuple(extra))
    if key not in _RESULTS:
        out = os.path.join(tmp_dir, f"{name}_tp{tp}_pp{pp}_cp{cp}_dp{dp}_freeze{int(freeze)}.pt")
        world = tp * pp * cp * dp
        spawn(_train_step, world, hf_dir, samples, tp, pp, freeze, out, tuple(extra), cp, dp, timeout=300)
        stages = [torch.load(f"{out}.{stage}", weights_only=False) for stage in range(pp)]
        exported = [n for s in stages for n in s["exported"]]
        assert sorted(exported) == sorted(read_checkpoint(hf_dir)), "the stages' exports are not the checkpoint"
        _RESULTS[key] = {
            "diff": stages[-1]["diff"],
            "moved": {k: v for s in stages for k, v in s["moved"].items()},
            "after": {k: v for s in stages for k, v in s["after"].items()},
        }
    return _RESULTS[key]


@pytest.fixture(scope="module")
def samples(tiny_vlm):
    return make_samples(tiny_vlm)


CLIP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "video", "clip_a.mp4")
KITS = {  # family: fixture
    "qwen2_5_vl": "tiny_vlm",
    "qwen3_vl": "tiny_qwen3_vl",
    "qwen3_vl_moe": "tiny_qwen3_vl_moe",
    "qwen3_5": "tiny_qwen3_5_vl",
    "qwen3_5_moe": "tiny_qwen3_5_moe_vl",
}
_SAMPLES = {}


def kit_and_samples(request, family):
    """The tiny kit of `family` and its samples (`make_samples`, made once per kit)."""
    kit = request.getfixturevalue(KITS[family])
    if kit not in _SAMPLES:
        _SAMPLES[kit] = make_samples(kit)
    return kit, _SAMPLES[kit]


def test_samples_mix_image_sizes_and_text_only_rows(samples):
    """The batch can expose ordering and padding bugs: per micro-batch, rows of different lengths, image counts and
    sizes (1 and 6 + 2 image tokens), a text-only row next to an image row."""
    grids = [
        s.multimodal_train_inputs["image_grid_thw"].tolist() if s.multimodal_train_inputs else [] for s in samples
    ]
    assert grids == [[[1, 2, 2]], [[1, 4, 6], [1, 4, 2]], [], [[1, 4, 4]]]
    assert len({len(s.tokens) for s in samples}) == 4


@pytest.mark.parametrize("freeze", [False, True], ids=["train", "freeze_visual"])
def test_log_probs_equal_transformers_and_the_vision_tower_trains(tiny_vlm, samples, freeze, tmp_path):
    result = train_once(tiny_vlm, samples, 1, freeze, str(tmp_path))
    print(f"trainer vs transformers max |log-prob diff| = {result['diff']:.3g}")
    moved = result["moved"]
    visual = [n for n in moved if n.startswith("visual.")]
    lm = [n for n in moved if not n.startswith("visual.")]
    assert len(visual) == 30  # every tensor of the tower is in the model (and the optimizer)
    if freeze:
        assert not any(moved[n] for n in visual), [n for n in visual if moved[n]]
    else:
        assert all(moved[n] for n in visual), [n for n in visual if not moved[n]]
    assert all(moved[n] for n in lm), [n for n in lm if not moved[n]]


# current slime's Qwen3.5 -vl model scripts: its provider's dotted path, and 1-D RoPE in the flags (the model's own 3-D)
UPSTREAM_QWEN3_5_VL = (
    "--spec", "slime_plugins.models.qwen3_5_vl", "get_qwen3_5_vl_model_provider", "--position-embedding-type", "rope",
)  # fmt: skip
FLAGS = {"qwen3_5": UPSTREAM_QWEN3_5_VL, "qwen3_5_moe": UPSTREAM_QWEN3_5_VL}  # family: extra flags of its runs


@pytest.mark.parametrize(
    "family, tower_tensors",
    [("qwen3_vl", 57), ("qwen3_vl_moe", 57), ("qwen3_5", 33), pytest.param("qwen3_5_moe", 33, marks=pytest.mark.slow)],
)
def test_qwen3_families_log_probs_equal_transformers_with_interleaved_mrope(request, family, tower_tensors, tmp_path):
    """Qwen3-VL and Qwen3.5 (dense and MoE) with its tower (slime_plugins/models/qwen3_vl.py) on the same kinds of
    samples: the trainer's log-probs equal transformers' within 1e-5 (measured 4.8e-7 for each; with megatron-core's
    contiguous MRoPE sections instead of the interleaved ones the gap is 5.9e-3 and 1.6e-3, without Qwen3-VL's
    DeepStack features 4.9e-2), the export is the checkpoint bit for bit under its `model.language_model.*` /
    `model.visual.*` names (`_train_step`), and one step moves every weight: Qwen3-VL's two DeepStack mergers (they
    feed decoder layers 0 and 1 of 3), Qwen3.5's Gated DeltaNet layer (and every expert of Qwen3.5-MoE's). Qwen3.5
    runs with the flags of current slime's -vl model scripts (`UPSTREAM_QWEN3_5_VL`)."""
    kit, samples = kit_and_samples(request, family)
    grids = [s.multimodal_train_inputs["image_grid_thw"].tolist() for s in samples if s.multimodal_train_inputs]
    assert grids == [[[1, 2, 2]], [[1, 4, 6], [1, 4, 2]], [[1, 4, 4]]]  # 16-px patches: 28 px round up to 32
    result = train_once(kit, samples, 1, False, str(tmp_path), extra=FLAGS.get(family, ()))
    print(f"{family} trainer vs transformers max |log-prob diff| = {result['diff']:.3g}")
    moved = result["moved"]
    visual = [n for n in moved if n.startswith("visual.")]
    assert len(visual) == len([n for n in read_checkpoint(kit) if n.startswith("model.visual.")]) == tower_tensors
    assert all(moved.values()), [n for n, m in moved.items() if not m]
    if family.startswith("qwen3_vl"):
        assert any("deepstack_merger_list.1." in n for n in visual)
    else:
        assert any(".linear_attn." in n for n in moved)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_videos_log_probs_equal_transformers_and_train_the_tower(request, family, tmp_path):
    """Videos beside images and text-only rows (`make_video_samples`): the trainer finds each video's tokens (one pad
    run, or one per temporal step behind its timestamp), encodes its pixels with the tower and gives it transformers'
    3-D positions (Qwen2.5-VL's temporal axis scaled by `second_per_grid_ts`; without it, or with the video's runs
    taken as text, the log-probs move far beyond 1e-5): the log-probs equal transformers' forward within 1e-5 and one
    step moves every weight."""
    kit, samples = video_samples(request, family)
    keys = [2, 4, 0, 2] if family != "qwen2_5_vl" else [3, 5, 0, 3]  # Qwen2.5-VL's videos add second_per_grid_ts
    assert [len(s.multimodal_train_inputs or {}) for s in samples] == keys
    result = train_once(kit, samples, 1, False, str(tmp_path), extra=FLAGS.get(family, ()), name="videos")
    print(f"{family} videos: trainer vs transformers max |log-prob diff| = {result['diff']:.3g}")
    assert all(result["moved"].values()), [n for n, m in result["moved"].items() if not m]


def _tools_round_trip(rank, kits, out):
    """tools/convert_hf_to_torch_dist.py's main (in this rank) and tools/convert_torch_dist_to_hf.py back, per kit."""
    from tests.test_converters import _assert_same_weights, _to_hf
    from tools.convert_hf_to_torch_dist import main as to_torch_dist

    for i, hf_dir in enumerate(kits):
        to_torch_dist(["--hf-checkpoint", hf_dir, "--save", f"{out}/{i}_release"])
        _to_hf("--input-dir", f"{out}/{i}_release", "--output-dir", f"{out}/{i}_hf", "--origin-hf-dir", hf_dir)
        _assert_same_weights(hf_dir, f"{out}/{i}_hf")


def test_converter_tools_round_trip_qwen3_vl_and_its_stacked_moe_bit_exactly(
    tiny_qwen3_vl, tiny_qwen3_vl_moe, tmp_path
):
    """HF -> torch_dist -> HF with the tools gives the checkpoint back bit for bit, vision tower included; Qwen3-VL-MoE's
    experts come back stacked as published (`gate_up_proj` [E, H, 2I], `down_proj` [E, I, H]): transformers loads
    its checkpoints only so."""
    spawn(_tools_round_trip, 1, [tiny_qwen3_vl, tiny_qwen3_vl_moe], str(tmp_path), timeout=300)
    stacked = read_checkpoint(str(tmp_path / "1_hf"))["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    assert stacked.shape == (4, 64, 48)


def test_interleaved_mrope_equals_transformers_qwen3_vl_rotary(tiny_qwen3_vl):
    """The trainer's rotary angles for 3-D positions whose axes differ equal transformers' Qwen3-VL's
    (`recomposition_frequencies`), and differ from megatron-core's contiguous sections."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
    from transformers import AutoConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from slime_plugins.models.qwen3_vl import InterleavedMultimodalRotaryEmbedding

    text = AutoConfig.from_pretrained(tiny_qwen3_vl).text_config
    positions = torch.stack([torch.arange(7) * k for k in (1, 3, 5)])[:, None].expand(3, 2, 7).clone()
    positions[:, 1] += 11  # a second row at other positions
    cos, sin = Qwen3VLTextRotaryEmbedding(text)(torch.zeros(1, dtype=torch.float32), positions)
    section = text.rope_parameters["mrope_section"]
    angles = {}
    for cls in (InterleavedMultimodalRotaryEmbedding, MultimodalRotaryEmbedding):
        rope = object.__new__(cls)  # megatron-core's constructor puts inv_freq on a CUDA device
        torch.nn.Module.__init__(rope)
        rope.inv_freq = 1.0 / (text.rope_parameters["rope_theta"] ** (torch.arange(0, 16, 2).float() / 16))
        rope.seq_len_interpolation_factor = None
        rope.cp_group, rope.rotary_interleaved = None, False
        angles[cls] = rope(positions, section)[:, :, 0].transpose(0, 1)  # [b, s, dim]
    ours = angles[InterleavedMultimodalRotaryEmbedding]
    assert torch.allclose(ours.cos(), cos, atol=1e-6) and torch.allclose(ours.sin(), sin, atol=1e-6)
    assert not torch.allclose(angles[MultimodalRotaryEmbedding].cos(), cos, atol=1e-2)


def test_qwen3_vl_needs_its_deepstack_layers_on_the_first_pipeline_stage():
    from slime_plugins.models.qwen3_vl import deepstack_layout_problem

    assert deepstack_layout_problem(3, [0, 1, 2, 3]) is None and deepstack_layout_problem(2, [0, 1]) is None
    problem = deepstack_layout_problem(3, [0, 1])
    assert "layer 2 is not" in problem and "--decoder-first-pipeline-num-layers" in problem
    assert len(problem.splitlines()) == 1


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
@pytest.mark.parametrize(
    "family, tp, pp",
    # Qwen3-VL-MoE at PP=2 only: megatron-core trains MoE with TP only under --sequence-parallel, which CPU runs drop
    [(f, tp, pp) for f in ("qwen2_5_vl", "qwen3_vl", "qwen3_5") for tp, pp in ((2, 1), (1, 2))]
    + [("qwen3_vl_moe", 1, 2)],
    ids=["tp2", "pp2", "qwen3_tp2", "qwen3_pp2", "qwen3_5_tp2", "qwen3_5_pp2", "qwen3_moe_pp2"],
)
def test_tp2_and_pp2_equal_tp1(request, family, tp, pp, tmp_path):
    """At TP=2 the tower is replicated on both ranks (the language model sharded); at PP=2 it runs on the first stage
    (each stage computes its samples' 3-D positions from the tokens). Either way the same log-probs, and after one
    step (lr 1, Adam eps 1: each weight moves by g / (|g| + 1) of its clipped gradient g) the same weights, tower
    included, as at TP=1: its gradients are neither summed over the TP ranks nor counted twice in the norm, and the
    stages' norms add up to the whole model's. Qwen3-VL: its DeepStack features too, at PP=2 with its two DeepStack
    layers on the first stage and the third on the second."""
    kit, samples = kit_and_samples(request, family)
    tp1 = train_once(kit, samples, 1, False, str(tmp_path), extra=FLAGS.get(family, ()))
    other = train_once(kit, samples, tp, False, str(tmp_path), pp=pp, extra=FLAGS.get(family, ()))
    print(f"tp{tp} pp{pp}: trainer vs transformers max |log-prob diff| = {other['diff']:.3g}")
    assert other["diff"] <= 1e-5
    assert sorted(other["after"]) == sorted(tp1["after"])
    gap = {k: (other["after"][k] - v).abs().max().item() for k, v in tp1["after"].items()}
    worst = max(gap, key=gap.get)
    print(f"tp{tp} pp{pp} vs tp1 weights after one step: max |diff| = {gap[worst]:.3g} ({worst})")
    assert gap[worst] <= 1e-5, (worst, gap[worst])


def video_samples(request, family):
    """The tiny kit of `family` and its `make_video_samples`, made once per kit."""
    kit = request.getfixturevalue(KITS[family])
    if ("videos", kit) not in _SAMPLES:
        _SAMPLES["videos", kit] = make_video_samples(kit)
    return kit, _SAMPLES["videos", kit]


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_cp2_equals_cp1_on_images_and_videos(request, family, tmp_path):
    """Context parallelism with images and videos: every CP rank gathers the whole sequence's ids, finds the media
    and 3-D positions on it and keeps its zigzag chunks' share (the tower runs on each rank; the gradient reduction
    over data and context parallel ranks adds up each rank's part of its gradient). The same log-probs as
    transformers' and, after one step, the same weights as CP=1, tower included (Qwen3.5: its Gated DeltaNet layer
    over the gathered sequence)."""
    kit, samples = video_samples(request, family)
    extra = FLAGS.get(family, ())
    cp1 = train_once(kit, samples, 1, False, str(tmp_path), extra=extra, name="videos")
    cp2 = train_once(kit, samples, 1, False, str(tmp_path), extra=extra, name="videos", cp=2)
    print(f"{family} cp2: trainer vs transformers max |log-prob diff| = {cp2['diff']:.3g}")
    assert cp2["diff"] <= 1e-5
    gap = {k: (cp2["after"][k] - v).abs().max().item() for k, v in cp1["after"].items()}
    worst = max(gap, key=gap.get)
    print(f"{family} cp2 vs cp1 weights after one step: max |diff| = {gap[worst]:.3g} ({worst})")
    assert gap[worst] <= 1e-5, (worst, gap[worst])


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
def test_ep2_equals_one_rank_on_qwen3_vl_moe(request, tmp_path):
    """Qwen3-VL-MoE at DP=2 with its 4 experts split over 2 expert-parallel ranks, on images and videos: each rank's
    log-probs equal transformers' and, after one step, every weight (each expert gathered from its rank, the tower
    included) equals one rank's within 1e-5 (measured 2.2e-8)."""
    kit, samples = video_samples(request, "qwen3_vl_moe")
    one = train_once(kit, samples, 1, False, str(tmp_path), name="videos")
    ep = train_once(
        kit, samples, 1, False, str(tmp_path), name="videos", dp=2, extra=("--expert-model-parallel-size", "2")
    )
    assert ep["diff"] <= 1e-5
    gap = {k: (ep["after"][k] - v).abs().max().item() for k, v in one["after"].items()}
    worst = max(gap, key=gap.get)
    print(f"qwen3_vl_moe ep2 vs one rank weights after one step: max |diff| = {gap[worst]:.3g} ({worst})")
    assert gap[worst] <= 1e-5, (worst, gap[worst])


def _lora_step(rank, hf_dir, samples, out):
    """`--enable-lora` on the vision-language model: log-probs before the step, which weights one GRPO step moves,
    the log-probs after it and the merged weights weight sync would send."""
    import warnings

    warnings.filterwarnings("ignore")
    import ray

    from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.lora import full_adapters, peft_config, peft_tensors
    from slime.backends.megatron_utils.model import forward_only, initialize_model_and_optimizer, train
    from slime.backends.megatron_utils.param_utils import PREFIX, named_parameters
    from slime.backends.megatron_utils.rollout_data import process_rollout_data
    from slime.rollout.train_data import convert_samples_to_train_data

    class _Ref:
        def __init__(self, data):
            self.inner = data

    ray.get = lambda x: x
    args = vlm_args(hf_dir, "--enable-lora", "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2")
    init(args)
    model, opt, sched, _ = initialize_model_and_optimizer(args)
    rollout = process_rollout_data(args, _Ref(convert_samples_to_train_data(args, samples)), 0, 1)
    iters, nmb = get_data_iterator(args, model, rollout)
    before_lp = forward_only(args, model, iters, nmb)["log_probs"]
    before = {n[len(PREFIX) :]: p.detach().clone() for n, p in named_parameters(args, model)}
    rollout.update(forward_only(args, model, iters, nmb, store_prefix="ref_"))
    rollout.update(forward_only(args, model, iters, nmb))
    compute_advantages_and_returns(args, rollout)
    train(args, 0, model, opt, sched, iters, nmb)  # B starts at 0: this step moves B (A's gradient is 0)
    moved = {n[len(PREFIX) :]: not torch.equal(before[n[len(PREFIX) :]], p) for n, p in named_parameters(args, model)}
    after_lp = forward_only(args, model, iters, nmb)["log_probs"]
    # what --lora-sync adapter sends: the PEFT tensors and config of the adapters
    adapter = peft_tensors(args, full_adapters(args, model), args.model_name)
    config = peft_config(args, {n.split(".lora_")[0].rsplit(".", 1)[1] for n in adapter})
    torch.save(
        {
            "before": before_lp,
            "after": after_lp,
            "moved": moved,
            "merged": _export(args, model),
            "adapter": {"config": config, "tensors": adapter},
        },
        out,
    )


def test_lora_trains_the_language_models_adapters_and_syncs_them_merged_or_as_adapters(tiny_vlm, samples, tmp_path):
    """`--enable-lora` with images: adapters on the language model's linear layers only (the vision tower, like every
    base weight, stays frozen); at the start the model is the checkpoint (transformers' log-probs);
    the merged weights that `--lora-sync merged` sends after a step, loaded into transformers' Qwen2.5-VL, give the
    trainer's log-probs: an engine serving them samples from the policy being trained. So do the adapters that
    `--lora-sync adapter` sends, loaded into the CPU server on the base checkpoint (its transformers model with the
    adapters hooked onto the decoder's projections), while a request without `lora_path` in the same batch gets
    the base's."""
    import shutil

    from safetensors.torch import save_file

    out = str(tmp_path / "lora.pt")
    spawn(_lora_step, 1, tiny_vlm, samples, out, timeout=300)
    res = torch.load(out, weights_only=False)
    ref = hf_vlm_log_probs(tiny_vlm, samples)
    assert max((g - e).abs().max().item() for g, e in zip(res["before"], ref)) <= 1e-5
    moved = res["moved"]
    assert any("lora" in n for n in moved) and not any("visual" in n and "lora" in n for n in moved)
    assert all(moved[n] for n in moved if "lora_B" in n), [n for n in moved if "lora_B" in n and not moved[n]]
    assert not any(moved[n] for n in moved if "lora" not in n), [n for n in moved if "lora" not in n and moved[n]]

    merged = tmp_path / "merged"
    merged.mkdir()
    for f in os.listdir(tiny_vlm):
        if not f.endswith(".safetensors"):
            shutil.copy2(os.path.join(tiny_vlm, f), merged / f)
    save_file(res["merged"], str(merged / "model.safetensors"))
    assert sorted(res["merged"]) == sorted(read_checkpoint(tiny_vlm))
    engine = hf_vlm_log_probs(str(merged), samples)
    gap = max((g - e).abs().max().item() for g, e in zip(res["after"], engine))
    moved_by = max((g - e).abs().max().item() for g, e in zip(res["after"], res["before"]))
    print(f"LoRA VLM: merged weights vs trainer log-probs after a step {gap:.3g} (the step moved them {moved_by:.3g})")
    assert moved_by > 1e-3 and gap <= 1e-5

    from slime.utils.processing_utils import image_prompt_fields, load_processor
    from tests.test_cpu_server import SESSION, start_cpu_server, stop_cpu_server
    from tests.test_cpu_server_lora import _load_from_tensors

    pad = load_processor(tiny_vlm).image_token_id
    proc, url = start_cpu_server(tiny_vlm, "--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "all")
    try:
        r = _load_from_tensors(url, "policy", res["adapter"])
        assert r.status_code == 200, r.text
        gaps = []
        for s, after, before in zip(samples, res["after"], res["before"]):
            images = (s.multimodal_inputs or {}).get("images")
            fields = image_prompt_fields(pad, s.tokens, images) if images else {"input_ids": s.tokens}
            body = {"input_ids": [fields["input_ids"]] * 2, "lora_path": ["policy", None], "logprob_start_len": 0}
            body |= {"sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
            if images:
                body["image_data"] = [fields["image_data"]] * 2
            r = SESSION.post(url + "/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            served, base = (
                torch.tensor([x[0] for x in o["meta_info"]["input_token_logprobs"][-s.response_length :]])
                for o in r.json()
            )
            gaps.append((served - after).abs().max().item())
            assert gaps[-1] <= 1e-5 and (base - before).abs().max() <= 1e-5, s.index
        print(f"LoRA VLM: adapters served by the CPU server vs trainer log-probs after a step {max(gaps):.3g}")
        # the decode steps serve the adapter too: their log-probs are the adapter's prefill of the same tokens
        body = {k: v[0] for k, v in body.items() if isinstance(v, list)} | {"return_logprob": True}
        out = SESSION.post(url + "/generate", json={**body, "sampling_params": {"max_new_tokens": 3}}, timeout=120)
        decoded = out.json()["meta_info"]["output_token_logprobs"]
        body["input_ids"] = body["input_ids"] + [t for _, t, _ in decoded]
        body |= {"logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}}
        again = SESSION.post(url + "/generate", json=body, timeout=120).json()["meta_info"]["input_token_logprobs"]
        assert max(abs(a[0] - b[0]) for a, b in zip(decoded, again[-3:])) <= 1e-5
    finally:
        stop_cpu_server(proc)


def _tree_samples(hf_dir):
    """Four GRPO pairs: two samples on image A whose responses branch; two on image B, of A's size (the same token
    ids as A's prompt), one with A's first response; two images (A and a small one) and a text-only sample; two on
    one video whose responses branch."""
    from slime.utils.processing_utils import load_processor, process_prompt
    from slime.utils.types import Sample

    processor = load_processor(hf_dir)
    a, b, c = _image((56, 84), 1), _image((56, 84), 2), _image((28, 28), 3)
    cases = [([a], [10, 11, 12, 13]), ([a], [10, 11, 14, 15, 16]), ([b], [10, 11, 12, 13]), ([b], [20, 21])]
    cases += [([a, c], [10, 11]), ([], [10, 11, 12]), ("video", [10, 11, 12]), ("video", [10, 13])]
    video_ids, pixels, grid = video_prompt(hf_dir, 4, 64, 32)
    samples = []
    for i, (images, response) in enumerate(cases):
        if images == "video":
            head, tail = processor.tokenizer(TEXT.split("{images}"), add_special_tokens=False)["input_ids"]
            ids, train_inputs = head + video_ids + tail, {"pixel_values_videos": pixels, "video_grid_thw": grid}
        else:
            ids, train_inputs = process_prompt(processor, TEXT.format(images=IMAGE * len(images)), images)
            train_inputs = train_inputs if images else None
        samples.append(
            Sample(
                index=i,
                tokens=ids + response,
                response_length=len(response),
                reward=float(i % 2 == 0),
                multimodal_train_inputs=train_inputs,
            )
        )
    return samples


def _tree_equality(rank, hf_dir, out):
    """Flat packing vs --tree-training on the same micro-batch: log-probs and gradients (lr 0)."""
    import warnings

    warnings.filterwarnings("ignore")
    import ray

    from slime.backends.megatron_utils.data import get_batch, get_data_iterator
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.model import forward_only, initialize_model_and_optimizer
    from slime.backends.megatron_utils.rollout_data import process_rollout_data
    from slime.rollout.train_data import convert_samples_to_train_data
    from tests.test_tree_training import flat_vs_tree_grads

    class _Ref:
        def __init__(self, data):
            self.inner = data

    ray.get = lambda x: x
    sizes = ["--rollout-batch-size", "4", "--global-batch-size", "8", "--micro-batch-size", "8"]
    args = vlm_args(hf_dir, *sizes, "--tree-training", "--lr", "0", "--clip-grad", "0")
    init(args)
    model, opt, sched, _ = initialize_model_and_optimizer(args)
    rollout = process_rollout_data(args, _Ref(convert_samples_to_train_data(args, _tree_samples(hf_dir))), 0, 1)
    iters, nmb = get_data_iterator(args, model, rollout)

    def with_tree(on):
        for it in iters:
            it.tree = on

    with_tree(False)
    flat = forward_only(args, model, iters, nmb)
    with_tree("dense")
    tree = forward_only(args, model, iters, nmb)
    row = get_batch(iters[0], ["tokens", "multimodal_train_inputs"])
    iters[0].reset()
    num, den, _ = flat_vs_tree_grads(args, model, opt, sched, iters, nmb, rollout, flat)
    torch.save(
        {
            "log_probs": max((x - y).abs().max().item() for x, y in zip(flat["log_probs"], tree["log_probs"])),
            "grad_rel": num / den,
            "row_tokens": row["tokens"].numel(),
            "flat_tokens": sum(t.numel() for t in row["unconcat_tokens"]),
        },
        out,
    )


@pytest.mark.parametrize("kit", ["tiny_vlm", "tiny_qwen3_vl"])  # Qwen2.5-VL; Qwen3-VL (DeepStack, interleaved MRoPE)
def test_tree_training_with_images_equals_flat_packing(request, kit, tmp_path):
    """--tree-training on images and videos: samples with the same media share their prompt (each encoded once), samples
    whose images differ never share a node even where their token ids agree, and every 3-D position is the sample's
    own; log-probs and gradients equal flat packing's."""
    out = str(tmp_path / "tree.pt")
    spawn(_tree_equality, 1, request.getfixturevalue(kit), out, timeout=300)
    r = torch.load(out)
    print(r)
    assert r["log_probs"] <= 2e-6 and r["grad_rel"] <= 2e-6, r
    assert r["row_tokens"] < r["flat_tokens"], r


def test_startup_derives_the_model_from_the_checkpoint_and_refuses_untested_layouts(
    tiny_vlm, tiny_qwen3_vl, tiny_qwen3_5_vl, capsys
):
    """`--hf-checkpoint` alone: the text config's qkv bias or q/k norm, MRoPE sections and LM head tying, the
    vision-language model provider. Qwen3.5's checkpoint with a tower takes it (and MRoPE) with --multimodal-keys only;
    without, its decoder trains alone as before. What is not tested yet stops at start-up in one line naming the
    flag."""
    from tests._args import one_line_refusal

    args = vlm_args(tiny_vlm)
    assert args.add_qkv_bias and args.position_embedding_type == "mrope" and args.mrope_section == [2, 3, 3]
    assert not args.qk_layernorm and not args.untie_embeddings_and_output_weights
    assert args.spec == ["slime_plugins.models.qwen2_5_vl", "get_qwen2_5_vl_model_provider"]
    assert (args.num_layers, args.hidden_size, args.num_query_groups, args.kv_channels) == (2, 64, 2, 16)
    args = vlm_args(tiny_qwen3_vl)
    assert not args.add_qkv_bias and args.qk_layernorm and args.untie_embeddings_and_output_weights
    assert args.position_embedding_type == "mrope" and args.mrope_section == [4, 2, 2]
    assert args.spec == ["slime_plugins.models.qwen3_vl", "get_qwen3_vl_model_provider"]
    assert (args.num_layers, args.hidden_size, args.num_query_groups, args.kv_channels) == (3, 64, 2, 16)
    args = vlm_args(tiny_qwen3_5_vl)
    assert args.spec == ["slime_plugins.models.qwen3_5_vl", "get_qwen3_5_vl_model_provider"]
    assert args.position_embedding_type == "mrope" and args.mrope_section == [4, 2, 2] and args.rotary_percent == 0.25
    keys_at = RL.index("--multimodal-keys")
    text_only = parse_args(argv=[*RL[:keys_at], *RL[keys_at + 2 :], "--hf-checkpoint", tiny_qwen3_5_vl])
    assert text_only.spec == ["slime_plugins.models.qwen3_5", "get_qwen3_5_spec"]
    assert text_only.position_embedding_type == "rope"
    keys = ["--multimodal-keys", '{"image": "images"}']
    assert (
        vlm_args(tiny_vlm, "--context-parallel-size", "2", "--actor-num-gpus-per-node", "2").context_parallel_size == 2
    )
    args = vlm_args(tiny_vlm, "--enable-lora", "--lora-sync", "adapter")  # taken: the engine serves the adapters
    assert args.lora_sync == "adapter"
    assert vlm_args(tiny_vlm, "--tree-training").tree_training  # taken; Qwen3.5's linear attention cannot share
    err = one_line_refusal(capsys, *keys, "--tree-training", hf_checkpoint=tiny_qwen3_5_vl)
    assert "--tree-training does not support a custom or hybrid layer spec" in err, err


def position_builder(hf_config, model_class=None):
    """A `Qwen2_5VLModel` (or `model_class`) with only what its token and position builder reads: no weights."""
    from slime_plugins.models.qwen2_5_vl import Qwen2_5VLModel, _RopeIndex

    model_class = model_class or Qwen2_5VLModel
    model = object.__new__(model_class)
    model.pad_ids = {"image": hf_config.image_token_id, "video": hf_config.video_token_id}
    model.vision_start_token_id = hf_config.vision_start_token_id
    model.merge = hf_config.vision_config.spatial_merge_size
    model.rope_index = _RopeIndex(hf_config, model_class.hf_classes(hf_config)[0])
    return model


def test_image_tokens_are_the_processors_runs_and_grids_that_disagree_fail_in_one_line(tiny_vlm):
    """The trainer finds each image's tokens as the processor lays them out: the run of image-pad ids after a
    <|vision_start|>, as long as the image's feature count, in order. An image-pad id the model generated (no bracket,
    or a run of another length) is text, as the engine keeps it: MRoPE counts it as text and no feature is written
    over it. Grids that disagree with the runs (a processor with other limits than the rollout's, a truncated
    prompt) fail in one line."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_vlm)
    model = position_builder(cfg)
    img, vs, ve, text = cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id, 20
    ids = torch.tensor([[text, vs, img, ve, text, img, text], [text, vs, img, img, img, img, ve]])
    types, positions, _ = model._media_tokens_and_positions(
        ids, None, {"image_grid_thw": torch.tensor([[1, 2, 2], [1, 4, 4]])}
    )
    # row 0: one 1-token image, then a generated image-pad id (text); row 1: a 2x2 merged grid
    assert types.tolist() == [[0, 0, 1, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1, 0]]
    assert positions[:, 0].tolist() == [[0, 1, 2, 3, 4, 5, 6]] * 3
    assert positions[:, 1].tolist() == [[0, 1, 2, 2, 2, 2, 4], [0, 1, 2, 2, 3, 3, 4], [0, 1, 2, 3, 2, 3, 4]]
    # row 1 holds 4 tokens, not 2: 1 image of 2 found; a third image: 2 of 3
    for grids, found in (([[1, 2, 2], [1, 4, 2]], 1), ([[1, 2, 2], [1, 4, 4], [1, 2, 2]], 2)):
        with pytest.raises(ValueError) as e:
            model._media_tokens_and_positions(ids, None, {"image_grid_thw": torch.tensor(grids)})
        msg = str(e.value)
        assert f"has {len(grids)} images in multimodal_train_inputs but its tokens hold the image-token runs" in msg
        assert msg.endswith(f"of {found}: multimodal_train_inputs do not match the tokens")
        assert len(msg.splitlines()) == 1


def test_each_sample_s_image_runs_match_its_own_grids_and_a_sample_that_disagrees_fails_naming_it(tiny_vlm):
    """`get_batch` tells the model how many images each sample of the micro-batch brought, and each sample's image
    runs are matched against its own grids (padded and packed layouts). A sample holding two 1-token image runs but
    one grid keeps its second run as text (a generated <|vision_start|> + pad), and the next sample's run is its own
    image (matched over the whole micro-batch, sample 0 took both grids and sample 1's image trained as text); a
    sample with more grids than runs fails in one line naming it and both counts."""
    from transformers import AutoConfig

    from slime.backends.megatron_utils.data import get_batch
    from slime.backends.megatron_utils.rollout_data import DataIterator

    cfg = AutoConfig.from_pretrained(tiny_vlm)
    model = position_builder(cfg)
    img, vs, ve, text = cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id, 20
    tokens = [torch.tensor([text, vs, img, ve, vs, img, ve]), torch.tensor([text, vs, img, ve])]
    one, two = {"image_grid_thw": torch.tensor([[1, 2, 2]])}, {"image_grid_thw": torch.tensor([[1, 2, 2]] * 2)}

    def build(mm, packed):
        it = DataIterator({"tokens": tokens, "multimodal_train_inputs": mm}, 2, packed_sequences=packed)
        batch = get_batch(it, ["tokens", "multimodal_train_inputs"])
        return model._media_tokens_and_positions(
            batch["tokens"], batch["packed_seq_params"], batch["multimodal_train_inputs"]
        )

    for packed in (False, True):
        second = (0, 9) if packed else (1, 2)  # sample 1's run
        types = build([two, one], packed)[0]  # each sample's runs are its images
        assert types[second] == 1 and (types == 1).sum() == 3
        types = build([one, one], packed)[0]  # sample 0's second run is text; sample 1's run is its image
        assert types[0, 2] == 1 and types[0, 5] == 0 and types[second] == 1 and (types == 1).sum() == 2
        with pytest.raises(ValueError) as e:
            build([None, two], packed)
        msg = str(e.value)
        assert msg.startswith("sample 1 of the micro-batch has 2 images in multimodal_train_inputs")
        assert msg.endswith("of 1: multimodal_train_inputs do not match the tokens") and "\n" not in msg


def test_video_tokens_are_one_run_per_video_or_per_temporal_step(tiny_vlm, tiny_qwen3_vl):
    """A Qwen2.5-VL video is one pad run after <|vision_start|>; a Qwen3-VL video one run per temporal step, each
    behind its timestamp and a <|vision_start|> of its own. Grids that disagree fail in one line."""
    from transformers import AutoConfig

    from slime_plugins.models.qwen3_vl import Qwen3VLModel

    for kit, model_class in ((tiny_vlm, None), (tiny_qwen3_vl, Qwen3VLModel)):
        cfg = AutoConfig.from_pretrained(kit)
        model = position_builder(cfg, model_class)
        v, vs, ve, ts = cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id, 20
        if model_class is None:  # 2 steps of 2 x 2 merged patches: 4 tokens in one run
            ids, types = [ts, vs, v, v, v, v, ve], [0, 0, 2, 2, 2, 2, 0]
        else:
            ids = [vs, ts, vs, v, v, ve, ts, vs, v, v, ve, ve]
            types = [0, 0, 0, 2, 2, 0, 0, 0, 2, 2, 0, 0]
        grid = {"video_grid_thw": torch.tensor([[2, 2, 4]])}
        got, positions, starts = model._media_tokens_and_positions(torch.tensor([ids]), None, grid)
        assert got[0].tolist() == types and starts == {"image": [], "video": [(0, 2 if model_class is None else 3)]}
        assert positions[0, 0, types.index(2) + 1] == positions[0, 0, types.index(2)]  # one step: one time
        with pytest.raises(ValueError) as e:
            model._media_tokens_and_positions(torch.tensor([ids]), None, {"video_grid_thw": torch.tensor([[2, 4, 4]])})
        per_frame = " per frame" if model_class else ""
        assert str(e.value) == (
            f"the micro-batch has 1 videos in multimodal_train_inputs but its tokens hold the video-token runs (id "
            f"{v}, each after <|vision_start|>, as long as its video's features{per_frame}) of 0: "
            "multimodal_train_inputs do not match the tokens"
        )


def _teacher_copy(kit, out):
    """A copy of the checkpoint at `kit` with its language model's first layer scaled by 1.25: another model that
    shares its tokenizer, processor and vision tower (an OPD teacher)."""
    import shutil

    from safetensors.torch import save_file

    out.mkdir()
    for f in os.listdir(kit):
        if not f.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy2(os.path.join(kit, f), out / f)
    weights = {k: v * 1.25 if ".layers.0." in k and "visual" not in k else v for k, v in read_checkpoint(kit).items()}
    save_file(weights, str(out / "model.safetensors"))
    return str(out)


def alternating_reward(args, sample):
    """1 for odd sample indices: every GRPO group has a non-zero advantage, so each step changes the weights."""
    return float(sample.index % 2)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5", "qwen3_vl_moe"])
def test_train_py_grpo_on_images_syncs_the_trained_tower_to_the_engine(request, family, tmp_path):
    """`train.py --multimodal-keys` on the tiny kit with the CPU server (Qwen2.5-VL, and Qwen3.5 with its tower,
    current slime's native vision-language model, chosen from the checkpoint alone): images (and, but for the OPD run,
    a video) from the dataset to the engine and the trainer, two GRPO steps, weight sync (vision tower included) between them. The engine's log-probs
    of the second rollout, sampled with the first step's weights, equal the trainer's: the whole model reached the
    engine. With --check-weight-update-equal the engine's every tensor, the tower's too, is overwritten with noise
    before the first push and must equal the checkpoint after it: the push leaves none out. The Qwen2.5-VL run trains
    on two pipeline stages (the tower on the first; the metrics file gets the last stage's training metrics). The
    Qwen3.5 run rolls out with examples/geo3k_vlm_multi_turn's generate: two turns with an image observation between
    them (loss-masked), so its log-prob check also covers images in the response, and distils (OPD) from a teacher
    on a CPU server of its own (the checkpoint with its first layer scaled): the teacher's log-probs of every
    response token, the observation's image tokens included, are transformers' forward of the teacher over the whole
    sequence with both images, so each image reached it where the trainer sees it. The Qwen3-VL-MoE run syncs every
    routed expert (per-expert tensors into the engine's fused ones) beside DeepStack's mergers, and its --save-hf
    output (experts stacked as published) loads in transformers with the trained weights."""
    import base64
    import io
    import json
    import subprocess
    import sys

    from transformers import AutoConfig, AutoModelForImageTextToText

    from tests import _procs, _ray_zygote
    from tests.test_cpu_server import start_cpu_server, stop_cpu_server

    tiny_vlm = request.getfixturevalue(KITS[family])
    multi_turn = family == "qwen3_5"
    rows = []
    for i, size in enumerate([(28, 28), (56, 56), (84, 56), (28, 56)]):
        buf = io.BytesIO()
        _image(size, i).save(buf, format="PNG")
        content = "<image>What colour is the shape?"
        rows.append(
            {"prompt": [{"role": "user", "content": content}], "images": [base64.b64encode(buf.getvalue()).decode()]}
        )
    if not multi_turn:  # a clip in the second prompt, to the engine as `video_data` and to the trainer (OPD: refused)
        rows[1] = {"prompt": [{"role": "user", "content": "<video>What moves?"}], "videos": [CLIP]}
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainers = "2" if family == "qwen2_5_vl" else "1"  # Qwen2.5-VL on two pipeline stages: the tower on the first
    argv = [
        "--hf-checkpoint", tiny_vlm, "--actor-num-gpus-per-node", trainers, "--rollout-num-gpus", "1",
        "--prompt-data", str(tmp_path / "train.jsonl"), "--input-key", "prompt", "--apply-chat-template",
        "--multimodal-keys", '{"image": "images"}' if multi_turn else '{"image": "images", "video": "videos"}',
        "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
        "--lr", "1e-2", "--lr-decay-style", "constant", "--rollout-max-response-len", "4", "--seed", "1", "--ci-test",
        "--metrics-path", str(tmp_path / "metrics.jsonl"), "--check-weight-update-equal",
    ]  # fmt: skip
    teacher = None
    if not multi_turn:
        argv += ["--custom-rm-path", "tests.test_vlm_trainer.alternating_reward"]
    else:
        teacher_dir = _teacher_copy(tiny_vlm, tmp_path / "teacher")
        teacher, teacher_url = start_cpu_server(teacher_dir)
        argv += ["--use-opd", "--opd-type", "sglang", "--opd-kl-coef", "1.0", "--rm-url", teacher_url + "/generate"]
        argv += ["--custom-rm-path", "slime.rollout.on_policy_distillation.reward_func"]
        argv += ["--custom-reward-post-process-path", "slime.rollout.on_policy_distillation.post_process_rewards"]
        config = tmp_path / "multi_turn.yaml"
        config.write_text("max_turns: 2\nrollout_interaction_env_path: tests._image_env\nmax_new_tokens_per_turn: 4\n")
        argv += ["--custom-generate-function-path", "examples.geo3k_vlm_multi_turn.rollout.generate"]
        argv += ["--custom-config-path", str(config), "--rollout-max-response-len", "64"]
        argv += ["--save-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.pt")]
    if trainers == "2":  # the training metrics come from the last stage
        argv += ["--pipeline-model-parallel-size", trainers]
    if family == "qwen3_vl_moe":  # the last step's model as an HF checkpoint, experts stacked as published
        argv += ["--save", str(tmp_path / "ckpt"), "--save-interval", "2", "--save-hf", str(tmp_path / "hf")]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = None
    try:
        proc = subprocess.Popen(
            [sys.executable, "train.py", *argv],
            cwd=repo,
            # the run's workers and servers forked from the session's pre-imported interpreter
            env=dict(_procs.run_env(tmp_path), PYTHONPATH=repo, **_ray_zygote.job_env()),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        out, _ = proc.communicate(timeout=480)
    finally:
        _procs.stop_run(proc, tmp_path, timeout=0)
        if teacher is not None:
            stop_cpu_server(teacher)
    assert proc.returncode == 0, out[-5000:]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/weight_version"] for m in metrics] == [1, 2]
    assert metrics[0]["train/grad_norm"] > 0
    for m in metrics:
        print(
            f"rollout {m['rollout_id']}: train_rollout_logprob_abs_diff {m['train/train_rollout_logprob_abs_diff']:.3g} ppo_kl {m['train/ppo_kl']:.3g} clip {m['train/pg_clipfrac']:.3g}"
        )
        assert m["train/train_rollout_logprob_abs_diff"] < 1e-4
        assert abs(m["train/ppo_kl"]) < 1e-6  # one step a rollout: the training pass sees what the log-prob pass saw
    assert _procs.wait_none_carrying(_procs.RUN_KEY, str(tmp_path), 30) == []
    if family == "qwen3_vl_moe":  # transformers loads --save-hf's output whole, with trained experts and tower
        saved = read_checkpoint(str(tmp_path / "hf"))
        start = read_checkpoint(tiny_vlm)
        assert sorted(saved) == sorted(start)
        for name in (
            "model.language_model.layers.0.mlp.experts.gate_up_proj",
            "model.visual.merger.linear_fc1.weight",
        ):
            assert saved[name].shape == start[name].shape and not torch.equal(saved[name], start[name]), name
        _, info = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
    if multi_turn:  # every sample: 4 model tokens, the observation (its image included), then the second answer
        from slime.rollout.on_policy_distillation import teacher_response_log_probs

        reference = AutoModelForImageTextToText.from_pretrained(teacher_dir, dtype=torch.float32).eval()
        pad = AutoConfig.from_pretrained(tiny_vlm).image_token_id
        samples = torch.load(tmp_path / "rollout_0.pt", weights_only=False)["samples"]
        gaps = []
        for s in samples:
            mask = s["loss_mask"]
            assert mask[:4] == [1] * 4 and 0 in mask and mask[-1] == 1, mask
            assert len(s["multimodal_train_inputs"]["image_grid_thw"]) == 2 == len(s["multimodal_inputs"]["images"])
            ids, n = torch.tensor([s["tokens"]]), s["response_length"]
            with torch.no_grad():
                logits = reference(
                    input_ids=ids, mm_token_type_ids=(ids == pad).long(), **s["multimodal_train_inputs"]
                ).logits[0, -n - 1 : -1]
            want = torch.log_softmax(logits.float(), -1).gather(1, ids[0, -n:, None]).squeeze(1)
            got = teacher_response_log_probs(s["reward"], n)  # the teacher's answer, as post-processing reads it
            assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
            student = torch.tensor(s["rollout_log_probs"])
            gaps.append(((got - student).abs() * torch.tensor(mask)).max())
        # a teacher other than the student, on the sampled tokens (the logged mean KL is signed: it can cancel)
        assert max(gaps) > 1e-2 and all("rollout/opd_reverse_kl" in m for m in metrics), gaps


def test_packed_rows_get_each_samples_own_3d_positions(tiny_vlm, samples):
    """The packed (THD) layout the GPU trainer uses: one row of the micro-batch's samples back to back, split by
    `cu_seqlens`, plus padding. Each sample's 3-D positions are exactly those it gets alone in the padded layout
    (transformers' `get_rope_index` on its tokens and its own images)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from transformers import AutoConfig

    model = position_builder(AutoConfig.from_pretrained(tiny_vlm))

    def positions(ids, params, grids):
        return model._media_tokens_and_positions(ids, params, {"image_grid_thw": grids})[1]

    grids = [s.multimodal_train_inputs["image_grid_thw"] for s in samples if s.multimodal_train_inputs]
    all_grids = torch.cat(grids)
    tokens = [torch.tensor(s.tokens) for s in samples]
    alone, g = [], 0
    for s, t in zip(samples, tokens):  # the padded layout, one sample per row
        n = len(s.multimodal_train_inputs["image_grid_thw"]) if s.multimodal_train_inputs else 0
        alone.append(positions(t[None], None, all_grids[g : g + n] if n else None)[:, 0])
        g += n
    pad = 5
    row = torch.cat([*tokens, torch.zeros(pad, dtype=torch.long)])[None]
    # as `_packed_layout` cuts it: the padding is a segment of its own
    cu = torch.tensor([0, *np.cumsum([len(t) for t in tokens]), row.size(1)], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    packed = positions(row, params, all_grids)[:, 0]
    for i, expect in enumerate(alone):
        got = packed[:, int(cu[i]) : int(cu[i + 1])]
        assert torch.equal(got, expect), i
    assert alone[0][:, -1].max() > len(tokens[0]) / 2  # 3-D positions, not offsets into the row
    assert torch.equal(packed[:, -pad:], torch.arange(pad).expand(3, pad))  # text positions of its own


def _megatron_teacher(rank, student_dir, teacher_dir, samples, ckpt, out):
    """The actor's own `--opd-type megatron` path on one rank: the teacher's Megatron checkpoint (written here from
    `teacher_dir`) loaded by `load_other_checkpoint`, then the forwards of `forward_passes` on the image samples."""
    import contextlib
    import copy
    import warnings

    warnings.filterwarnings("ignore")
    import ray
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron_utils.actor import MegatronTrainRayActor
    from slime.backends.megatron_utils.checkpoint import save_checkpoint
    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.megatron_to_hf.hf_to_megatron import hf_to_megatron
    from slime.backends.megatron_utils.model import initialize_model_and_optimizer
    from slime.backends.megatron_utils.rollout_data import process_rollout_data
    from slime.rollout.train_data import convert_samples_to_train_data

    class _Ref:
        def __init__(self, data):
            self.inner = data

    ray.get = lambda x: x  # the test hands the dict itself instead of an ObjectRef
    opd = ["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", ckpt]  # written below
    args = parse_args(argv=[*RL, "--hf-checkpoint", student_dir, *opd], check_paths=False)
    init(args)
    model, _, _, _ = initialize_model_and_optimizer(args)
    actor = object.__new__(MegatronTrainRayActor)  # its methods, without Ray and the engines
    actor.args, actor.model, actor.weights = args, model, {"actor": {}}
    actor.prof = types.SimpleNamespace(phase=lambda name: contextlib.nullcontext())
    actor.update_cpu_params_dict(actor.weights["actor"])
    hf_to_megatron(args, model, hf_checkpoint=teacher_dir)  # the teacher as --opd-teacher-load holds it
    save_args = copy.copy(args)
    save_args.save = ckpt
    save_checkpoint(save_args, 1, model, None, None, with_optimizer=False)
    actor.update_gpu_params_dict(actor.weights["actor"])
    actor.load_other_checkpoint("teacher", ckpt)  # as `init` does with --opd-type megatron

    data = convert_samples_to_train_data(args, samples)
    rollout = process_rollout_data(args, _Ref(data), mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())
    iters, nmb = get_data_iterator(args, model, rollout)
    for tag, _, prefix, _ in actor.forward_passes(len(nmb)):
        rollout.update(actor.compute_log_prob(tag, iters, nmb, prefix))
    torch.save({k: rollout[k] for k in ("teacher_log_probs", "log_probs")}, out)


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
def test_megatron_opd_teacher_sees_the_images(tiny_vlm, samples, tmp_path):
    """`--use-opd --opd-type megatron` on image samples: the teacher (another Qwen2.5-VL, its tower included, swapped
    into the live model) gets the micro-batch's pixel_values and grids like the policy, so its log-probs equal
    transformers' forward of the teacher on the same tokens and images, and the student's stay the student's."""
    import shutil

    from safetensors.torch import load_file, save_file

    teacher_dir = str(tmp_path / "teacher")
    shutil.copytree(tiny_vlm, teacher_dir)
    weights = load_file(os.path.join(teacher_dir, "model.safetensors"))
    for name, t in weights.items():  # other weights, the tower's included
        if name.startswith("visual.") or name == "model.norm.weight":
            t.mul_(3.0)
    save_file(weights, os.path.join(teacher_dir, "model.safetensors"), metadata={"format": "pt"})

    out = str(tmp_path / "lps.pt")
    spawn(_megatron_teacher, 1, tiny_vlm, teacher_dir, samples, str(tmp_path / "teacher_ckpt"), out, timeout=300)
    got = torch.load(out, weights_only=False)
    teacher, student = hf_vlm_log_probs(teacher_dir, samples), hf_vlm_log_probs(tiny_vlm, samples)
    diff = max((g - w).abs().max().item() for g, w in zip(got["teacher_log_probs"], teacher))
    print(f"megatron teacher vs transformers' teacher: max |log-prob diff| = {diff:.3g}")
    assert diff <= 1e-5
    assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got["log_probs"], student))
    assert not torch.allclose(teacher[1], student[1], atol=1e-2)  # two different models
