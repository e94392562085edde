"""The worker replica as a Ray Serve deployment: its options, the actor, its metrics."""
