"""The extract stage."""
