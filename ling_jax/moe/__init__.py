"""The mixture-of-experts feed-forward: the routed block (`block`), the expert FFN kernels' entry points
(`experts`) and expert parallelism over a mesh (`expert_parallel`). Part of the model; imports only the core."""
