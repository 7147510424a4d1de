"""Contracts: the formats the control plane, the agent, the CLI and the root update helper
exchange.

A contract module belongs to neither side. It holds what two sides must agree on byte for
byte (a signed update order and its canonical JSON, the spool through which the agent hands
an order to the root helper, an inventory as the control plane stores it, the model catalog
that ``llmgw ctl`` and the control plane both check) and the checks both sides run on it, so
that each side imports the one definition instead of the other side's code. A contract
module imports nothing from ``llmgw.agent``, ``llmgw.server``, ``llmgw.cli`` or
``llmgw.updater``: only the standard library, ``llmgw.errors``, the protobuf messages
(``llmgw.proto``), the foundation modules and, for the catalog's engines and their
parameters, ``llmgw.engines``.
"""
