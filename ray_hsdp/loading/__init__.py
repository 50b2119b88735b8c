"""Loading a model: finding its folder, reading each rank's slices (staged reads, page cache, FP8
folders), the start's checks on meta, and LoRA files. Below ``variant``, above ``checkpoints``
(which writes what it reads: the embedded model is written through it before a model path
resolves): may import checkpoints, sharding, config and the shared modules."""
