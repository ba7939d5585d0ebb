"""tvrpipe.training: see ../DESIGN.md; filled in by later stages."""
