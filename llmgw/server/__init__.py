"""The control plane (`llmgw server`): store, stream, scheduler, gateway, admin API; docs/architecture.md maps it."""
