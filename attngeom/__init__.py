"""attngeom: geometric analysis of token selection in multi-head attention."""

__version__ = "0.1.0"
