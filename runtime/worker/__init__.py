"""The device side: model runner, step executor, kernels, sampler, sharding, parameters."""
