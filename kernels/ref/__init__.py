"""Pure-torch references of every kernel: same signatures as the Triton kernels, fp32 math.

They are also the CPU runtime path, so the whole stack runs (slowly) without a GPU.
"""
