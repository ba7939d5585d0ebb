"""tvrpipe.evaluation: see ../DESIGN.md; filled in by later stages."""
