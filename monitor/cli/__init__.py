"""The ``attention-monitor`` command line.

Exit codes (:class:`monitor.errors.ExitCode`): 0 success; 1 a check failed (an audit
FAIL, an invalid configuration); 2 bad usage or unreadable input; 3 an infrastructure
error (broker unreachable, authorization refused) after retries; 4 the service's
measuring process died; 130 interrupted.
"""

from __future__ import annotations

from monitor.cli import admin, models, service, serving
from monitor.cli.app import app

__all__ = ["app", "main"]
_COMMANDS = (admin, models, service, serving)  # imported for the commands they register on ``app``


def main() -> None:
    import prometheus_client

    # `_created` samples would double every counter and histogram series (docs/metrics.md).
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    app()
