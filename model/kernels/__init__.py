"""C++ CPU kernels called from JAX through ``jax.ffi``; setup.py builds them at install time.

The built libraries are plain shared objects (loaded with ctypes, not imported); their
Python wrappers and jnp fallbacks live in ``model`` (e.g. ``model.paged_decode``).
"""
