"""--ref-update-interval on a real `MegatronTrainRayActor` (Ray, CPU/gloo, tiny Qwen3 kit).

The KL loss compares the training forward's log-probs with the reference model's. Before any training they are the
same weights, so the KL is exactly 0; after one optimizer step it is not. With --ref-update-interval 2 the
reference becomes the actor after rollouts 1, 3, ...: rollout 2 starts from reference == actor again (KL exactly
0), and rollout 3 has moved away (KL != 0)."""

import pytest

from tests._args import make_args
from tests._megatron_helpers import fixed_rollout, train_args
from tests.test_megatron_actor import _kill, _make_actors


def test_reference_follows_the_actor_every_interval(ray_session, tiny_kit):
    from slime.utils.ray_utils import Box

    ray = ray_session
    args = train_args(tiny_kit[0], kl_loss_coef=0.01, ref_update_interval=2)
    (actor,) = _make_actors(ray, 1)
    try:
        assert ray.get(actor.init.remote(args, "actor", None, with_ref=True), timeout=300) == 0
        kl = []
        for rollout_id in range(4):
            result = ray.get(actor.train.remote(rollout_id, Box(ray.put(fixed_rollout()))), timeout=300)
            kl.append(result["train"][0]["train/kl_loss"])
    finally:
        _kill(ray, [actor])
    assert kl[0] == 0.0 and kl[1] != 0.0
    assert kl[2] == 0.0  # the reference was replaced by the actor after rollout 1
    assert kl[3] != 0.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--use-kl-loss", "--ref-update-interval", "0"], "--ref-update-interval 0: must be a number of rollouts"),
        (["--ref-update-interval", "2"], "--ref-update-interval updates the reference model, but this job has none"),
    ],
)
def test_bad_interval_stops_at_startup(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        make_args(*argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_interval_parses_as_upstream():
    assert make_args().ref_update_interval is None
    assert make_args("--use-kl-loss", "--ref-update-interval", "3").ref_update_interval == 3
