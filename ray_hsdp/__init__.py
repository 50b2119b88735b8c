"""ray_hsdp: huge diffusion models served by sharded groups of Ray actors. The packages follow the
data flow, each importing only what lies below it (``pyproject.toml``'s import-linter contracts,
run by ``make test``): ``cli`` > ``serve`` > ``group`` > ``rank`` > ``pipeline`` > ``runtime`` >
``variant`` > ``loading`` > ``checkpoints`` > ``sharding`` > ``distributed`` > ``config`` >
``deadlines`` | ``memory`` | ``phases`` > ``protocol`` | ``request``."""
