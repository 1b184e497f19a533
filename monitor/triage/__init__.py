"""On-call triage from the monitor's own records: a text summary (``text``) and a
self-contained HTML page per incident or layer (``evidence`` gathers, ``charts`` draws,
``page`` renders)."""
