"""The analyze stage."""
