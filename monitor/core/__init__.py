"""The pure core: numpy and the standard library only.

Metrics of attention traces, mergeable accumulators, detection, the join buffer and
content identities. Nothing here logs, reads settings or imports the rest of the
package.
"""
