"""The ingress' tests (``ray_hsdp.serve.ingress``)."""
