"""The public face for model-server code: everything needed to publish traces.

    from monitor.producer import LayerContract, ModelContract, Scope, TraceHeader, TraceProducer

The wire format is in ``docs/wire-format.md``; the transformers integration
(:mod:`monitor.integrations.transformers`) builds headers and contracts from a live model.
"""

from pathlib import Path

from monitor.broker.producer import TraceProducer
from monitor.protocol.access import Keyring
from monitor.protocol.codec import encode
from monitor.protocol.model_contract import LayerContract, ModelContract
from monitor.protocol.schema import FAILURE_LABELS, OUTCOMES, SUCCESS_LABELS, Scope, TaskOutcome, TraceHeader
from monitor.protocol.topics import Topics

__all__ = [
           "FAILURE_LABELS",
           "OUTCOMES",
           "SUCCESS_LABELS",
           "LayerContract",
           "ModelContract",
           "Scope",
           "TaskOutcome",
           "Topics",
           "TraceHeader",
           "TraceProducer",
           "encode",
           "signing_secret",
]


def signing_secret(keyring_file: str | Path, key_id: str) -> bytes:
    """The secret of ``key_id`` in a keyring file (as ``attention-monitor keyring new``
    writes it); a model server signs its traces with it."""
    secret = Keyring.from_file(Path(keyring_file)).secret(key_id)
    if secret is None:
        raise KeyError(f"no key {key_id!r} in {keyring_file}")
    return secret
