"""The extract stage. Called, ``attngeom.extract(model, ...)`` is :func:`attngeom.api.extract`."""
