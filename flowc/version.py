"""flowc's version, in a module of its own so that every layer may read it without importing
the package's API (flowc/__init__.py)."""

__version__ = "0.1.0"
