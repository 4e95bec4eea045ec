"""The analyze stage. Called, ``attngeom.analyze(store, ...)`` is :func:`attngeom.api.analyze`."""
