"""Who holds the store and its runs: the root and the writers' hold, a run's local lock and its
lease on an object store. Imports only :mod:`attngeom.store.objects`."""
