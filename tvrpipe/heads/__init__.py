"""tvrpipe.heads: see ../DESIGN.md; filled in by later stages."""
