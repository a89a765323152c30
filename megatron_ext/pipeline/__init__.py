"""Pipeline-parallel communication: what megatron-ext changes in how stages exchange tensors."""
