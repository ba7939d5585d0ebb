"""Stage one: decoded frames -> CLIP features -> the Zarr feature store (and HDF5 export, generated stores)."""
