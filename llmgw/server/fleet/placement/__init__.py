"""Where replicas go: a pure placement engine (no store, no I/O) that the reconcile loop asks,
once per pass, for the nodes and GPUs of each replica it is missing.

Filter, then score. A node takes a shard when it is approved, connected, not draining, not
lost, offers the engine (and does not hold it back: a desired build not yet installed and
checked there, see :func:`offered_engines`), has the profile's source under its models_root
or may fetch it (:mod:`llmgw.contracts.model_sources`), is not in ``avoid``, is not degraded
for it (:func:`degraded_refusal`) and has enough free GPUs (and, for a profile with
``host_memory``, that much of its memory left by its sleepers and its replicas' own
``host_memory``: the scheduler tells the view what sleepers hold); the shards of a multi-node
replica go to distinct nodes that share one healthy fabric. ``binpack`` fills nodes up
(fewest free GPUs that still fit, and for multi-node the fabric with the fewest spare nodes);
``spread`` prefers the emptiest nodes and fabrics.

GPUs are exclusive: an allocation holds its GPUs whole, and ``gpu_memory_mib`` is a fit check
against each GPU's size, not a share of it. vLLM and SGLang claim a fixed fraction of the
whole GPU when they start (vLLM 0.9 by default), so two engines on one GPU fail unless each is
told its share, which nothing passes them today. A profile with ``gpus == 0`` (the sim engine,
CPU engines) holds no GPU and any number of them may share a node.

The modules: :mod:`.views` (what placement is given and answers), :mod:`.cluster` (the view
a pass places into), :mod:`.index` (the nodes each kind of profile may use, by free GPUs and
fabric), :mod:`.refusal` (why no node fits, per group of nodes; per node on demand),
:mod:`.pairs` (where a disaggregated model's pool replicas may go: one fabric or one node).
"""

from llmgw.server.fleet.placement.cluster import Cluster
from llmgw.server.fleet.placement.pairs import PoolAsk, pair_home, paired_nodes
from llmgw.server.fleet.placement.refusal import Unplaceable
from llmgw.server.fleet.placement.views import (
    STRATEGIES,
    Allocation,
    GpuView,
    NodeView,
    Placement,
    Profile,
    ShardPlacement,
    degraded_refusal,
    offered_engines,
)

__all__ = [
    "STRATEGIES",
    "Allocation",
    "Cluster",
    "GpuView",
    "NodeView",
    "Placement",
    "PoolAsk",
    "Profile",
    "ShardPlacement",
    "Unplaceable",
    "degraded_refusal",
    "offered_engines",
    "pair_home",
    "paired_nodes",
]
