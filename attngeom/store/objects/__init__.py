"""The store's names and layout, its objects and their bytes: a URL's zarr Store, a local store's
files, codecs, the cache of an object store, a first look before zarr loads, the damage they
name and the command lines that rewrite it. The store's lowest layer: it imports nothing else
of the store."""
