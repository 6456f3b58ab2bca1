"""benchbackend: which backend runs your network fastest, and correctly."""

__version__ = "0.1.0"
