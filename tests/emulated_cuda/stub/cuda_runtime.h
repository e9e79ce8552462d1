// Stands in for <cuda_runtime.h> when train.cuh's kernels are compiled for the
// host (cuda_host.h supplies what they use); nothing of the runtime is needed.
#pragma once
