"""The model replica deployment (``HSDPServer``): one replica per shard group, running its requests and jobs."""
