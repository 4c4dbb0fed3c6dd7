"""The mixture-of-experts feed-forward: the routed block (`block`), the routed experts' maths around the kernels
(`experts`) and expert parallelism over a mesh (`expert_parallel`). Part of the model; imports only the core."""
