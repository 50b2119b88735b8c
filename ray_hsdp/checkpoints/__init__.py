"""Writers of local diffusers folders: the embedded tiny pipeline and real-size random checkpoints."""
