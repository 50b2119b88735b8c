"""The sharded diffusers pipeline a rank runs: its call's arguments, request slots, split decodes and
frames on the host. Below the rank: may import runtime, variant, loading, sharding, config and the
shared modules; not rank, group, serve or cli."""
