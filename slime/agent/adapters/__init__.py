"""HTTP adapters that serve agent runtimes' chat APIs over the policy's engine and record their trajectories."""

from slime.agent.adapters.anthropic import AnthropicAdapter
from slime.agent.adapters.common import AdapterError, BaseAdapter
from slime.agent.adapters.openai import OpenAIAdapter

__all__ = ["AdapterError", "AnthropicAdapter", "BaseAdapter", "OpenAIAdapter"]
