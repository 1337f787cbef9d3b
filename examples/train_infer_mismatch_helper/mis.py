"""Masked / truncated importance sampling (MIS / TIS) between the trainer's and the inference engine's policy.

Point slime at it with

    --use-tis \
    --custom-tis-function-path examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp \
    --custom-config-path examples/train_infer_mismatch_helper/mis.yaml

or, to only watch the mismatch (the loss stays as it is), `--get-mismatch-metrics` instead of `--use-tis`.

The weight of a token is rho = pi_train / pi_rollout of the sampled token, taken at one of three levels:
`token` (rho_t), `sequence` (the product of the sample's rho_t) or `geometric` (their geometric mean), all
computed in log space over the loss-masked tokens. Then

- IS (`use_tis`): `tis_mode` truncate caps the weight at `tis_upper_bound`; clip clamps it to
  [`tis_lower_bound`, `tis_upper_bound`]; mask keeps it inside that band and drops the token (weight 0, out of
  the loss) outside it;
- RS (`use_rs`, rejection sampling): tokens whose weight at `rs_level` lies outside [`rs_lower_bound`,
  `rs_upper_bound`] are dropped; with `rs_veto_threshold`, a sample with any token of rho below it is dropped as
  a whole;
- `tis_batch_normalize`: the weights are divided by their mean over every loss-masked token (per sample at the
  sequence and geometric levels) of the micro-batch, rejected tokens included, as current slime's helper does.

Every knob is read from `args` (set by `--custom-config-path`); a knob the config does not give takes the value
in `DEFAULTS`. Dropped tokens leave the loss's numerator only: each sample keeps its original denominator.
"""

import torch

DEFAULTS = {
    "use_rs": False,
    "tis_level": "token",
    "rs_level": "token",
    "tis_mode": "truncate",
    "tis_lower_bound": None,  # None: 1 / tis_upper_bound
    "tis_upper_bound": 2.0,
    "rs_lower_bound": None,  # None: the IS band
    "rs_upper_bound": None,
    "rs_veto_threshold": None,
    "tis_batch_normalize": False,
}
LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "clip", "mask")
LOG_BOUND = 20.0  # |log rho| cap before exp: keeps a sequence-level product finite


def _knobs(args):
    knobs = {k: vars(args).get(k, v) for k, v in DEFAULTS.items()}
    knobs["use_tis"] = args.use_tis
    for key, allowed in (("tis_level", LEVELS), ("rs_level", LEVELS), ("tis_mode", MODES)):
        if knobs[key] not in allowed:
            raise ValueError(f"--custom-config-path: {key} is {knobs[key]!r}; expected one of {', '.join(allowed)}")
    upper = float(knobs["tis_upper_bound"])
    lower = float(knobs["tis_lower_bound"]) if knobs["tis_lower_bound"] is not None else 1.0 / upper
    knobs["tis_upper_bound"], knobs["tis_lower_bound"] = upper, lower
    knobs["rs_lower_bound"] = lower if knobs["rs_lower_bound"] is None else float(knobs["rs_lower_bound"])
    knobs["rs_upper_bound"] = upper if knobs["rs_upper_bound"] is None else float(knobs["rs_upper_bound"])
    return knobs


def _masked_mean(x, mask):
    return (x * mask).sum() / torch.clamp_min(mask.sum(), 1)


def _level_log_ratio(log_ratio, mask, level):
    """Per-token log weight at `level`: the token's own, or the sample's masked sum / mean on every token."""
    if level == "token":
        return log_ratio
    agg = (log_ratio * mask).sum() if level == "sequence" else _masked_mean(log_ratio, mask)
    return agg.expand_as(log_ratio)


def _mismatch_values(train, rollout, mask):
    """Per-token values describing how far the trainer's policy is from the engine's on this sample."""
    r = train - rollout
    rho = torch.exp(r.clamp(-LOG_BOUND, LOG_BOUND))
    train_lp, rollout_lp = _masked_mean(train, mask), _masked_mean(rollout, mask)
    seq = lambda v: v.expand_as(r)  # noqa: E731  (a per-sample value on every token)
    return {
        "kl": -r,
        "k3_kl": rho - 1 - r,
        "training_log_ppl": seq(-train_lp),
        "rollout_log_ppl": seq(-rollout_lp),
        "log_ppl_abs_diff": seq((rollout_lp - train_lp).abs()),
        "chi2_token": seq(_masked_mean(rho.square(), mask) - 1),
        "chi2_seq": seq(torch.exp(2 * (r * mask).sum().clamp(-LOG_BOUND, LOG_BOUND)) - 1),
    }


def compute_mis_weights(args, *, train_log_probs, rollout_log_probs, loss_masks):
    """`(weights, masks, metrics)` per sample: importance weights (None without `use_tis`), the loss masks with
    rejected tokens zeroed, and `{name: [per-token tensor per sample]}` metrics."""
    k = _knobs(args)
    if not len(train_log_probs) == len(rollout_log_probs) == len(loss_masks):
        raise ValueError(
            f"{len(train_log_probs)} train, {len(rollout_log_probs)} rollout log-prob and {len(loss_masks)} mask "
            "samples: they must match"
        )
    metrics = {}

    def add(name, value):
        metrics.setdefault(name, []).append(value.detach().float())

    for train, rollout, mask in zip(train_log_probs, rollout_log_probs, loss_masks):
        if not train.shape == rollout.shape == mask.shape:
            raise ValueError(
                f"per-sample shapes differ: train {train.shape}, rollout {rollout.shape}, mask {mask.shape}"
            )
        for name, value in _mismatch_values(train.float(), rollout.float(), mask.float()).items():
            add(name, value)
    if not k["use_tis"]:
        return None, loss_masks, metrics

    weights, masks = [], []
    for train, rollout, mask in zip(train_log_probs, rollout_log_probs, loss_masks):
        m = mask.float()
        log_ratio = (train - rollout).float()
        kept = m.clone()
        w = torch.exp(_level_log_ratio(log_ratio, m, k["tis_level"]).clamp(-LOG_BOUND, LOG_BOUND))
        add("tis_weight_before_bound", w)
        low, high = k["tis_lower_bound"], k["tis_upper_bound"]
        if k["tis_mode"] == "truncate":
            add("tis_truncate_fraction", (w > high).float())
            w = w.clamp(max=high)
        elif k["tis_mode"] == "clip":
            add("tis_clip_fraction_low", (w < low).float())
            add("tis_clip_fraction_high", (w > high).float())
            w = w.clamp(low, high)
        else:  # mask
            add("tis_mask_fraction_low", (w < low).float())
            add("tis_mask_fraction_high", (w > high).float())
            kept = kept * ((w >= low) & (w <= high)).float()  # out of band: rejected by the mask, weight kept
        if k["use_rs"]:
            rs_w = torch.exp(_level_log_ratio(log_ratio, m, k["rs_level"]).clamp(-LOG_BOUND, LOG_BOUND))
            rs_low, rs_high = k["rs_lower_bound"], k["rs_upper_bound"]
            add("rs_mask_fraction_low", (rs_w < rs_low).float())
            add("rs_mask_fraction_high", (rs_w > rs_high).float())
            kept = kept * ((rs_w >= rs_low) & (rs_w <= rs_high)).float()
            if k["rs_veto_threshold"] is not None:
                catastrophic = (log_ratio < torch.log(torch.tensor(float(k["rs_veto_threshold"])))) & (m > 0)
                add("rs_catastrophic_token_fraction", catastrophic.float())
                vetoed = catastrophic.any()
                add("rs_catastrophic_seq_fraction", vetoed.float().expand_as(w))
                if vetoed:
                    kept = torch.zeros_like(kept)
        weights.append(w * (m > 0))  # padding / masked-out tokens carry no weight
        masks.append(kept.to(mask.dtype))

    if k["tis_batch_normalize"]:
        # as current slime's helper: the mean over every loss-masked token (or sample), rejected ones included
        if k["tis_level"] == "token":
            total = sum((w * m).sum() for w, m in zip(weights, loss_masks))
            count = sum(m.sum() for m in loss_masks)
        else:  # one weight per sample
            total = sum(_masked_mean(w, m.float()) for w, m in zip(weights, loss_masks))
            count = len(weights)
        mean = total / count if count else None
        factor = mean if mean is not None and mean > 1e-8 else torch.tensor(1.0)
        weights = [w / factor for w in weights]
        for w in weights:
            add("batch_norm_factor", factor.expand_as(w))
    for w, mask in zip(weights, loss_masks):
        add("is_weight_final", w)
    return [w.detach() for w in weights], masks, metrics


def compute_mis_weights_with_cp(
    args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, **kwargs
):
    """The `--custom-tis-function-path` entry point: `(pg_loss * weights, masks, {"mis_<name>": per-token})`.

    slime's loss hands TIS functions every sample's whole response, also under context parallelism (each CP rank
    gathers the response's log-probs before the loss), so the weights are computed once over whole samples here.
    """
    weights, masks, metrics = compute_mis_weights(
        args, train_log_probs=train_log_probs, rollout_log_probs=rollout_log_probs, loss_masks=loss_masks
    )
    if weights is not None:
        pg_loss = pg_loss * torch.cat(weights).to(pg_loss.dtype) if weights else pg_loss
    device = pg_loss.device
    return pg_loss, masks, {f"mis_{name}": torch.cat(values).to(device) for name, values in metrics.items()}
