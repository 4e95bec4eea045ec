"""Analysis, ablation and detect groups: their write, their commit record, the plan of an update
and their reading through the record. Imports only the layers below (objects, holds,
extracted)."""
