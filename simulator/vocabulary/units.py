"""Byte sizes the cost and memory models count in.

The cost model counts every weight, activation, gradient and KV entry as bf16; fp32 where a part is
kept in full precision (Adam's states, Megatron's main gradients, the CPU engines' tensors)."""

BF16 = 2  # bytes per bf16 element
FP32 = 4  # bytes per fp32 element
MiB = 2**20
GiB = 2**30
