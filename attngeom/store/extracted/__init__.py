"""Runs and what extract writes: the per-sequence commit, extract's write of a run, a run's
arrays read a chunk at a time, groups as Datasets, and the checks every reader makes before
it reads. Imports only the layers below (objects, holds)."""
