"""The routing audit: the numpy reference of multi-head attention ("parallel
representation routing") and an audit of one layer's frozen head records against its
declared routing contract, naming everything by content identity
(:mod:`monitor.core.identity`). Pure: numpy and the standard library only."""
