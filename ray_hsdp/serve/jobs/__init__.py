"""The cluster's video job store (a detached actor), and the client the ingress and the replicas reach it by."""
