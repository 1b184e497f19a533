"""Tools around the service: the embedded demo, synthetic traffic and on-call triage.
The service never imports them."""
