"""Where programs run: device meshes and sharding rules, shape buckets, what the backend
supports, and the persistent compilation cache."""
