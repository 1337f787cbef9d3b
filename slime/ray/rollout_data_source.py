"""slime v0.1.0 location of the rollout data source; the classes now live in `slime.rollout.data_source`."""

from slime.rollout.data_source import DataSource, RolloutDataSource, RolloutDataSourceWithBuffer, pop_first

__all__ = ["DataSource", "RolloutDataSource", "RolloutDataSourceWithBuffer", "pop_first"]
