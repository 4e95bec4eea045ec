"""The ablate stage."""
