"""The node agent (`llmgw agent`): what runs on each GPU machine; docs/architecture.md maps it."""
