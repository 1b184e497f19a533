"""Integrations with model-serving code, each behind an optional extra
(``pip install attention-monitor[transformers]``). The service and the core never import
them."""
