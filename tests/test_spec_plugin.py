"""`--spec MODULE FN` called as current slime calls it: `FN(args, config, vp_stage)`, which may return a layer spec
or a model provider; slime v0.1.0's `FN(args)` still works."""

import sys

import pytest
from megatron.core.models.gpt import GPTModel

from slime.backends.megatron_utils import cpu_compat
from slime.backends.megatron_utils.model_provider import get_model_provider_func
from tests._args import make_args

pytestmark = pytest.mark.usefixtures("mpu_world1")  # a one-rank Megatron world (conftest)

PLUGIN = """
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

CALLS = []


def spec_new(args, config, vp_stage):
    CALLS.append(("new", args.hidden_size, config.hidden_size, vp_stage))
    return get_gpt_layer_local_spec()


def spec_old(args):
    CALLS.append(("old", args.hidden_size))
    return get_gpt_layer_local_spec()


def spec_provider(args, config, vp_stage):
    def provider(pre_process=True, post_process=True, vp_stage=None):
        CALLS.append(("provider", pre_process, post_process, vp_stage))
        return "built by the plugin"

    return provider
"""


@pytest.fixture()
def plugin(tmp_path, monkeypatch):
    cpu_compat.apply()  # as the trainer's init does (CPU only; a no-op on GPU)
    (tmp_path / "my_spec_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_spec_plugin

    yield my_spec_plugin
    sys.modules.pop("my_spec_plugin", None)


def test_spec_called_with_args_config_vp_stage(plugin):
    provider = get_model_provider_func(make_args("--spec", "my_spec_plugin", "spec_new", vocab_size=128))
    assert isinstance(provider(pre_process=True, post_process=True, vp_stage=None), GPTModel)
    assert plugin.CALLS == [("new", 64, 64, None)]


def test_v010_spec_called_with_args_only(plugin):
    provider = get_model_provider_func(make_args("--spec", "my_spec_plugin", "spec_old", vocab_size=128))
    assert isinstance(provider(pre_process=True, post_process=True), GPTModel)
    assert plugin.CALLS == [("old", 64)]


def test_spec_returning_a_model_provider_builds_the_model(plugin):
    provider = get_model_provider_func(make_args("--spec", "my_spec_plugin", "spec_provider", vocab_size=128))
    assert provider(pre_process=True, post_process=False, vp_stage=None) == "built by the plugin"
    assert plugin.CALLS == [("provider", True, False, None)]
