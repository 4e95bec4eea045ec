"""The store's names and layout, its objects and their bytes: a URL's zarr Store, a local store's
files, codecs, the cache of an object store, a first look before zarr loads, and the damage
and recovery they name. The store's lowest layer: it imports nothing else of the store."""
