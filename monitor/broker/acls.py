"""The Kafka ACLs each principal of a deployment needs, and nothing more
(``attention-monitor acls apply``; docker-compose.yml runs it at start).

- ``monitor``: reads traces, outcomes, contracts and reference decisions; reads and
  writes its outputs (it reads them back after a restart); its consumer group; its
  transactional ids (``<group>-…``), which commit outputs with offsets.
- ``model-server``: writes traces, outcomes and model contracts.
- ``operator``: writes reference decisions; reads outputs, decisions and contracts
  (``triage``, ``status``, ``reference list``).

Anything else is denied: the broker runs with ``allow.everyone.if.no.acl.found=false``.
"""

from __future__ import annotations

from typing import Any

from kafka import KafkaAdminClient
from kafka.admin import ACL, ACLOperation, ACLPermissionType, ACLResourcePatternType, ResourcePattern, ResourceType
from kafka.errors import KafkaError

from monitor.broker.errors import infrastructure_error
from monitor.errors import InfrastructureError
from monitor.protocol.topics import Topics

ROLES = ("monitor", "model-server", "operator")
READ, WRITE, DESCRIBE = "READ", "WRITE", "DESCRIBE"


def grants(role: str, topics: Topics, group_id: str) -> list[tuple[ResourceType, str, bool, list[str]]]:
    """(resource type, name, prefixed, operations) for ``role``."""
    if role == "monitor":
        return [
            *((ResourceType.TOPIC, t, False, [READ, DESCRIBE])
              for t in (topics.traces, topics.outcomes, topics.contracts, topics.references)),
            *((ResourceType.TOPIC, t, False, [READ, WRITE, DESCRIBE]) for t in (topics.anomalies, topics.dead_letter)),
            (ResourceType.GROUP, group_id, False, [READ]),
            (ResourceType.TRANSACTIONAL_ID, f"{group_id}-", True, [WRITE, DESCRIBE]),
        ]
    if role == "model-server":
        return [(ResourceType.TOPIC, t, False, [WRITE, DESCRIBE])
                for t in (topics.traces, topics.outcomes, topics.contracts)]
    if role == "operator":
        return [(ResourceType.TOPIC, topics.references, False, [READ, WRITE, DESCRIBE]),
                *((ResourceType.TOPIC, t, False, [READ, DESCRIBE])
                  for t in (topics.anomalies, topics.dead_letter, topics.contracts))]
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")


def acls(principal: str, role: str, topics: Topics, group_id: str) -> list[ACL]:
    return [ACL(principal, "*", ACLOperation[op], ACLPermissionType.ALLOW,
                ResourcePattern(rtype, name, ACLResourcePatternType.PREFIXED if prefixed
                                else ACLResourcePatternType.LITERAL))
            for rtype, name, prefixed, ops in grants(role, topics, group_id) for op in ops]


def apply_acls(kafka_config: dict[str, Any], principal: str, role: str, topics: Topics, group_id: str) -> int:
    """Create ``role``'s ACLs for ``principal`` (``User:name``); returns how many."""
    wanted = acls(principal, role, topics, group_id)
    admin = None
    try:
        admin = KafkaAdminClient(**kafka_config)
        result = admin.create_acls(wanted)
    except KafkaError as exc:
        raise infrastructure_error("creating ACLs failed", exc) from exc
    finally:
        if admin is not None:
            admin.close()
    if result["failed"]:
        raise InfrastructureError(f"the broker refused ACLs for {principal}: {result['failed'][:3]}", retriable=False)
    return len(wanted)
