"""Executors run a plan's groups of cells: ``local`` (this machine, one cell at a time) and ``ray``."""
