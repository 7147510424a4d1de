"""High availability (DESIGN §8): who leads and what the others do.

- ``leadership``  the :class:`Role` enum, the :class:`Leadership` interface and its SQLite
  kind (the state directory's lock);
- ``lease``       its PostgreSQL kind (a lease in the shared database);
- ``roles``       the role machine: lead, stand by, step down, take over;
- ``standby``     what a standby serves (agents' streams refused, naming the leader);
- ``handover``    :8080's socket kept across changes of role (PostgreSQL);
- ``instances``   the instances' registry in the shared database;
- ``drain``       a stop that drops no request (/healthz 503, listeners closed, in-flight
  requests awaited).
"""

from llmgw.server.ha.drain import Drain, DrainOutcome, stop_accepting
from llmgw.server.ha.handover import Handover
from llmgw.server.ha.instances import Instances
from llmgw.server.ha.leadership import FileLock, Leadership, Role
from llmgw.server.ha.lease import LeaseKeeper
from llmgw.server.ha.roles import RoleParts, Roles
from llmgw.server.ha.standby import LEADER_HTTP, LEADER_STREAM, Standby, leader_ssl

__all__ = [
    "LEADER_HTTP",
    "LEADER_STREAM",
    "Drain",
    "DrainOutcome",
    "FileLock",
    "Handover",
    "Instances",
    "Leadership",
    "LeaseKeeper",
    "Role",
    "RoleParts",
    "Roles",
    "Standby",
    "leader_ssl",
    "stop_accepting",
]
