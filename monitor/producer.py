"""The public face for model-server code: everything needed to publish traces.

    from monitor.producer import LayerContract, ModelContract, Scope, TraceHeader, TraceProducer

The wire format is in ``docs/wire-format.md``; the transformers integration
(:mod:`monitor.integrations.transformers`) builds headers and contracts from a live model.
"""

from monitor.broker.producer import TraceProducer
from monitor.codec import encode
from monitor.model_contract import LayerContract, ModelContract
from monitor.schema import OUTCOMES, Scope, TaskOutcome, TraceHeader
from monitor.topics import Topics

__all__ = [
           "OUTCOMES",
           "LayerContract",
           "ModelContract",
           "Scope",
           "TaskOutcome",
           "Topics",
           "TraceHeader",
           "TraceProducer",
           "encode",
]
