"""perfx's NumPy-CPU reference backend: plain float32 NumPy, exact with respect to the int4 weights."""
