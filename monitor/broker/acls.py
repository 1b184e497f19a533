"""The Kafka ACLs each principal of a deployment needs, and nothing more
(``attention-monitor acls apply``; docker-compose.yml runs it at start).

- ``monitor``: reads traces, outcomes, contracts and reference decisions; reads and
  writes its outputs (it reads them back after a restart), the observations on their
  way to their judge and the judges' state; its consumer group; its transactional ids
  (``<group>-…``), which commit outputs with offsets.
- ``model-server``: writes traces, outcomes and model contracts.
- ``operator``: writes reference decisions; reads outputs, decisions and contracts
  (``triage``, ``status``, ``reference list``).

Anything else is denied: the broker runs with ``allow.everyone.if.no.acl.found=false``.
"""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AclBinding, AclOperation, AclPermissionType, ResourcePatternType, ResourceType

from monitor.broker.admin import admin_client
from monitor.broker.connection import Connection
from monitor.broker.errors import from_librdkafka
from monitor.errors import InfrastructureError
from monitor.protocol.topics import Topics

ROLES = ("monitor", "model-server", "operator")
READ, WRITE, DESCRIBE = "READ", "WRITE", "DESCRIBE"
TIMEOUT_S = 30.0


def grants(role: str, topics: Topics, group_id: str) -> list[tuple[ResourceType, str, bool, list[str]]]:
    """(resource type, name, prefixed, operations) for ``role``."""
    if role == "monitor":
        return [
            *((ResourceType.TOPIC, t, False, [READ, DESCRIBE])
              for t in (topics.traces, topics.outcomes, topics.contracts, topics.references)),
            *((ResourceType.TOPIC, t, False, [READ, WRITE, DESCRIBE])
              for t in (topics.anomalies, topics.dead_letter, topics.observations, topics.judge_state,
                        topics.pending)),
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


def acls(principal: str, role: str, topics: Topics, group_id: str) -> list[AclBinding]:
    return [AclBinding(rtype, name, ResourcePatternType.PREFIXED if prefixed else ResourcePatternType.LITERAL,
                       principal, "*", AclOperation[op], AclPermissionType.ALLOW)
            for rtype, name, prefixed, ops in grants(role, topics, group_id) for op in ops]


def apply_acls(connection: Connection, principal: str, role: str, topics: Topics, group_id: str) -> int:
    """Create ``role``'s ACLs for ``principal`` (``User:name``); returns how many."""
    wanted = acls(principal, role, topics, group_id)
    refused = []
    admin = admin_client(connection)  # held until every answer is in: a dropped client cancels them
    try:
        for binding, future in admin.create_acls(wanted, request_timeout=TIMEOUT_S).items():
            try:
                future.result(timeout=TIMEOUT_S + 5)
            except KafkaException as exc:
                error = exc.args[0] if exc.args else None
                refused.append(f"{binding.restype} {binding.name} {binding.operation}: "
                               f"{error.name() if isinstance(error, KafkaError) else exc}")
    except KafkaException as exc:
        raise from_librdkafka("creating ACLs failed", exc) from exc
    if refused:
        raise InfrastructureError(f"the broker refused ACLs for {principal}: {refused[:3]}", retriable=False)
    return len(wanted)
