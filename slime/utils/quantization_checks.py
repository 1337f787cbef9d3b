"""Start-up checks of a quantised `--hf-checkpoint` (FP8 / INT4 rollouts) and of INT4 fake QAT against it; run by
`startup_checks.check_inputs`, one line per failure."""

import os

from slime.utils.user_errors import one_line


def check_quantized_checkpoint(args, error):
    """A quantised `--hf-checkpoint` (a `quantization_config` in its config.json, as current slime switches FP8 / INT4
    rollout on; other methods pass updates through in full precision, as in current slime): its config must be one
    this build serves. Training quantises every weight update into it (blockwise FP8 or compressed-tensors W4A16, over
    every transport); other formats are refused unless
    `--debug-rollout-only`. With INT4 fake QAT on, the trainer's grid must be the checkpoint's."""
    from slime.utils.quantization import QuantizationConfigError, QuantScheme, hf_quantization_config

    hf = getattr(args, "hf_checkpoint", None)
    qc = hf_quantization_config(hf)
    if not qc:
        if hf and not getattr(args, "debug_rollout_only", False):
            check_no_int4_qat(args, hf, error, "in full precision (no quantization_config)")
        return
    try:
        scheme = QuantScheme(qc, f"--hf-checkpoint {hf}: quantization_config")
    except QuantizationConfigError as e:
        error(one_line(e))
        return
    kind = scheme.kind
    if getattr(args, "debug_rollout_only", False):
        return
    rollout_only = (
        "; use --debug-rollout-only to serve it without training, or train with the full-precision checkpoint"
    )
    label = "INT4" if kind == "int4" else "FP8"
    if kind not in ("fp8_block", "int4"):
        error(
            f"--hf-checkpoint {hf} is quantised ({kind}): training into it (quantise-on-sync) is implemented for "
            f"blockwise FP8 and compressed-tensors W4A16 only{rollout_only}"
        )
    elif getattr(args, "enable_lora", False) and getattr(args, "lora_sync", None) == "adapter":
        error(
            f"--hf-checkpoint {hf} is quantised ({label}): --lora-sync adapter onto a quantised base is not supported "
            "(use --lora-sync merged: merged weights are quantised on sync)"
        )
    elif kind == "int4":
        dense = next((m for m in int4_packed_modules(hf) if ".experts." not in m), None)
        if dense is not None:
            error(
                f"--hf-checkpoint {hf} packs {dense} (not a routed expert) in INT4: SGLang cannot take online updates "
                "into dense INT4 linears (it repacks them for Marlin without a way back); convert with "
                f"tools/convert_hf_to_int4_direct.py's default --ignore-rules (routed experts only){rollout_only}"
            )
            return
        check_int4_qat_grid(args, hf, scheme, error)
    else:
        check_no_int4_qat(args, hf, error, "in FP8 (quantization_config quant_method fp8)")


def check_no_int4_qat(args, hf, error, served):
    """INT4 fake QAT on while the engine serves the experts `served` otherwise (FP8, or full precision): the policy
    would train on a grid it is never served on."""
    from slime.utils.quantization import INT4_QAT_FLAG as FLAG
    from slime.utils.quantization import qat_group_size

    try:
        group = qat_group_size({**os.environ, **(getattr(args, "train_env_vars", None) or {})})
    except ValueError:
        group = 0  # a malformed group size: the flag is on all the same
    if group is not None:
        error(
            f"{FLAG}=1 fake-quantises the routed experts in INT4, but --hf-checkpoint {hf} serves them {served}: "
            f"unset {FLAG}, or serve an INT4 checkpoint (tools/convert_hf_to_int4_direct.py --is-symmetric)"
        )


def int4_packed_modules(hf):
    """The modules an INT4 checkpoint stores packed (`<module>.weight_packed`), from its safetensors headers."""
    import glob

    from safetensors import safe_open

    suffix = ".weight_packed"
    for fn in sorted(glob.glob(os.path.join(hf, "*.safetensors"))):
        with safe_open(fn, framework="pt") as f:
            yield from sorted(k[: -len(suffix)] for k in f.keys() if k.endswith(suffix))


def check_int4_qat_grid(args, hf, scheme, error):
    """OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1 (the trainers' environment: the driver's, then --train-env-vars) makes the
    trainer compute with symmetric INT4 experts of group OPEN_TRAINING_INT4_GROUP_SIZE; the engine serves the
    checkpoint's grid. A policy trained on one grid and served on another is not what QAT promises."""
    from slime.utils.quantization import INT4_QAT_FLAG as FLAG
    from slime.utils.quantization import INT4_QAT_GROUP_SIZE as GROUP_SIZE
    from slime.utils.quantization import qat_group_size

    env = {**os.environ, **(getattr(args, "train_env_vars", None) or {})}
    try:
        group = qat_group_size(env)
    except ValueError as e:
        error(one_line(e))
        return
    if group is None:
        return
    if group != scheme.group_size:
        error(
            f"{FLAG}=1 fake-quantises experts with {GROUP_SIZE}={group}, but --hf-checkpoint {hf} is quantised with "
            f"group_size {scheme.group_size} (quantization_config.config_groups): set {GROUP_SIZE}={scheme.group_size}"
            " so the policy trains on the grid it is served on"
        )
    elif not scheme.symmetric:
        error(
            f"{FLAG}=1 fake-quantises experts symmetrically, but --hf-checkpoint {hf} is asymmetric INT4 "
            "(quantization_config symmetric: false): convert it with tools/convert_hf_to_int4_direct.py --is-symmetric"
        )
    else:
        # each expert-TP rank fake-quantises its shard of linear_fc2, whose input (FFN) dimension is split: the
        # shard's groups are the full weight's only if the group divides the shard
        etp = getattr(args, "expert_tensor_parallel_size", None) or getattr(args, "tensor_model_parallel_size", 1)
        ffn = getattr(args, "moe_ffn_hidden_size", None)
        if etp > 1 and ffn and (ffn // etp) % group:
            error(
                f"{FLAG}=1 with {GROUP_SIZE}={group}: --expert-tensor-parallel-size {etp} splits each expert's "
                f"linear_fc2 input ({ffn}, --moe-ffn-hidden-size) into shards of {ffn // etp}, which the group does not "
                "divide; use an expert tensor parallel size whose shards it divides"
            )
