"""Writers of local diffusers folders: the embedded tiny pipeline and real-size random checkpoints.

Layer: below ``loading`` (it writes what ``loading`` reads; the FP8 folder, which quantizes through
``loading``'s steps, is written by ``ray_hsdp.cli.quantize``): may import sharding, config and the
shared modules, never loading."""
