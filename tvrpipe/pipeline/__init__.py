"""Stage one: manifests -> frames -> CLIP features -> the Zarr feature store (and HDF5 export)."""
