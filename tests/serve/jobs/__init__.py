"""The job store's tests (``ray_hsdp.serve.jobs``)."""
