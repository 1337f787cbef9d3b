"""Current slime's flags honoured here (parse level and the code they drive), with values worked out by hand."""

import pytest

from slime.backends.sglang_utils.sglang_engine import server_command
from tests._args import make_args


def _error(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        make_args(*argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "argv, train, rollout",
    [
        ([], False, False),
        (["--offload"], True, True),
        (["--offload-train"], True, False),
        (["--offload-rollout"], False, True),
        (["--colocate"], True, True),
        (["--colocate", "--no-offload-rollout"], True, False),
        (["--colocate", "--no-offload-train"], False, True),
        (["--offload", "--no-offload-train"], True, True),  # --offload sets both, as in current slime
    ],
)
def test_offload_train_and_rollout(argv, train, rollout):
    a = make_args(*argv)
    assert (a.offload_train, a.offload_rollout, a.offload) == (train, rollout, train or rollout)


def test_offload_rollout_drives_the_sglang_memory_saver():
    for argv, saver in ((["--offload-rollout"], True), (["--offload-train"], False)):
        a = make_args(*argv, inference_server="sglang")
        _, cmd = server_command(a, 0, "127.0.0.1", 1, 2, "127.0.0.1:3")
        assert ("--enable-memory-saver" in cmd) == saver


def test_offload_is_refused_by_train_async(capsys):
    from slime.utils.arguments import parse_args
    from tests._args import BASE, TINY_MODEL

    with pytest.raises(SystemExit):
        parse_args(argv=[*BASE, *TINY_MODEL, "--offload-rollout"], check_paths=False, asynchronous=True)
    assert "--offload-train/--offload-rollout" in capsys.readouterr().err


def test_num_gpus_per_node_is_the_rollout_gpus_per_node():
    a = make_args("--num-gpus-per-node", "4")
    assert (a.rollout_num_gpus_per_node, a.num_gpus_per_node) == (4, 4)
    assert make_args("--rollout-num-gpus-per-node", "2").num_gpus_per_node == 2
