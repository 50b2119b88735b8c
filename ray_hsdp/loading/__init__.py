"""Loading a model: finding its folder, reading each rank's slices (staged reads, page cache, FP8
folders), the start's checks on meta, and LoRA files. Below the pipeline (with ``checkpoints``,
which writes what it reads): may import sharding, config and the shared modules."""
