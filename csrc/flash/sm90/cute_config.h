// CuTe settings of the sm90 family; every sm90 header includes this first, before any CuTe or
// CUTLASS header.
#pragma once

// wgmma shapes whose N is not a power of two (64x80x16 for d256's 80-key tiles, 64x160x16,
// ...). Without it CuTe's op selectors fall back to the largest listed N that divides the tile:
// d256's S = Q K^T ran as 5 wgmmas of 64x16x16 per k-slice instead of one 64x80x16 (each
// re-reading Q from shared memory). The configs static_assert the N they get.
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif
