"""The first stages of a search: one module per backend."""
