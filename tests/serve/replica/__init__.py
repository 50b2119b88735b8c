"""The model replica's tests (``ray_hsdp.serve.replica``)."""
