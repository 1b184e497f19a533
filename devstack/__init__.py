"""Real services for development and tests: Apache Kafka (KRaft, from Maven Central),
Prometheus and Alertmanager (Debian packages).

Nothing here is part of the shipped ``monitor`` package. Tests use it through
fixtures in ``tests/conftest.py``; ``python -m devstack --help`` starts the same
services by hand.
"""
