"""The tool's version: written into every store it creates and every page it builds."""

__version__ = "0.1.0"
