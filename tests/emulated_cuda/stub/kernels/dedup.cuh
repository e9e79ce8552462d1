// Stands in for kernels/dedup.cuh (CUB's radix sort and run list) when
// train.cuh's kernels are compiled for the host: the update kernels need only
// its parameters; the driver sorts the ids itself, stably, as CUB does, and
// lists the runs.
#pragma once

#include "kernels/dedup_params.h"
