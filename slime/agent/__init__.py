"""Agentic RL: protocol adapters that let agent clients drive the policy, and sandboxes for their tools."""
