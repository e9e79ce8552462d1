// Stands in for kernels/dedup.cuh (CUB's radix sort) when train.cuh's kernels
// are compiled for the host: the update kernels need only its parameters; the
// driver sorts the ids itself, stably, as CUB does.
#pragma once

#include "kernels/dedup_params.h"
