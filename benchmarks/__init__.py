"""How fast is it, beside its peers: `specair bench`, its peers and report, the prompt sets, and per-graph scripts."""
