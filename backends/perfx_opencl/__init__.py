"""perfx's OpenCL backends (pyopencl): ``opencl`` for any device, ``opencl-adreno`` with Adreno kernel variants."""
