// FERRY_HOST_CLONES: a host loop compiled once per instruction set (AVX-512, AVX2 and the x86-64
// baseline) and picked at load time, where the compiler makes clones (GCC, clang >= 14 on x86-64);
// not in sanitizer builds, whose runtimes are not set up yet when the loader runs a clone's
// resolver. The host lane's loops use it (the host optimizer, the host casts).
// FERRY_HOST_CLONES_ACTIVE says whether this build makes them (1) or runs the baseline loop (0).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && (!defined(__clang__) || __clang_major__ >= 14) && \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define FERRY_HOST_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define FERRY_HOST_CLONES_ACTIVE 1
#else
#define FERRY_HOST_CLONES
#define FERRY_HOST_CLONES_ACTIVE 0
#endif
