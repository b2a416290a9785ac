"""glm53.kernels: compute kernels (Triton on GPU) and their pure-torch references.

Imports nothing of ours and knows nothing about requests. Callers use `glm53.kernels.ops`.
"""
