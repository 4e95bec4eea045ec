"""A store checked against its contract, repaired, its metadata rebuilt, migrated. Imports only
the layers below (objects, holds, extracted, derived_groups)."""
