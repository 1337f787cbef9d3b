"""Old location of the trainer's rollout-data helpers; they serve only the Megatron backend and now live in
`slime.backends.megatron_utils.rollout_data`. This path is that module itself (not a copy of some of its names), so
everything it defines, and a monkeypatch through this path, reaches the code that runs."""

import sys

from slime.backends.megatron_utils import rollout_data

sys.modules[__name__] = rollout_data
