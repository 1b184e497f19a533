"""Measuring traces: the measurer (decode, verify, metrics, detector), batching traces
of close key counts, and where it runs beside the consumer (a thread, or child
processes fed through a shared ring)."""
