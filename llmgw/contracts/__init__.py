"""Contracts shared by the control plane, the agent and the CLI, owned by none of them."""
