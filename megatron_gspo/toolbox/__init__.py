"""Tools a model calls in an episode and the sandboxes that run its code: the registry
(:mod:`.tools`), the python tool's local bubblewrap sandbox (:mod:`.bwrap`) and remote service
(:mod:`.remote`), chosen by :mod:`.sandbox`."""
