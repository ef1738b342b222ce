"""specair: speculative decoding as ahead-of-time compiled static graphs."""

__version__ = "0.1.0"
