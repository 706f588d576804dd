"""Taktiny's version, as the installed package's metadata gives it (pyproject.toml writes it
once)."""

from importlib.metadata import version

__version__ = version("taktiny")
