"""Building blocks for tests: a model contract, keys, scopes and valid records."""

from __future__ import annotations

import numpy as np

from monitor.protocol.access import Keyring, ScopePolicy
from monitor.protocol.codec import Limits, decode, encode
from monitor.tools.synthetic import SyntheticModel, layer_roles, make_header, sample_positions, trace_weights

KEY_ID = "test-key"
SECRET = b"test-secret-0123456789abcdef"
KEYRING = Keyring({KEY_ID: SECRET})
SCOPES = ScopePolicy.parse(["demo:synthetic", "acme:*"])
MODEL = SyntheticModel("test-model", "rev-1", layers=2, heads=4, kv_groups=2)
CONTRACT = MODEL.contract()
CONTRACTS = {CONTRACT.contract_id: CONTRACT}


def make_trace(seed: int = 0, layer: int = 0, keys: int = 32, rows: int = 4, dtype: str = "float16",
               collapse: float = 0.0, contract=CONTRACT, **header_fields):
    """A valid trace of ``contract`` (another revision of the same model: ``MODEL``'s heads)."""
    rng = np.random.default_rng(seed)
    positions = sample_positions(rng, keys, rows)
    header = make_header(contract, layer, positions, keys, dtype=dtype, **header_fields)
    weights = trace_weights(rng, layer_roles(layer, MODEL.heads), positions, keys, collapse=collapse,
                            dtype=np.float16 if dtype == "float16" else np.float32)
    return header, weights


def make_record(seed: int = 0, **kwargs) -> bytes:
    header, weights = make_trace(seed, **kwargs)
    return encode(header, weights, KEY_ID, SECRET)


def decode_default(data: bytes, limits: Limits | None = None):
    return decode(data, keyring=KEYRING, scopes=SCOPES, contracts=CONTRACTS, limits=limits)
