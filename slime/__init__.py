"""slime: Ray-native RL post-training (Megatron-Core trains, SGLang or slime's CPU server generates)."""

from slime.utils.device import eager_megatron_fusions, quiet_expected_warnings

# every slime process (driver, Ray actors, CPU server) imports this package before megatron-core
quiet_expected_warnings()
eager_megatron_fusions()
