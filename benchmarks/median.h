// The median of per-round times (or ratios), shared by the protocol benchmarks here
// (hop_protocol.c, exchange_protocol.c).
#pragma once

#include <stdlib.h>
#include <string.h>

// qsort's comparison of doubles, ascending.
static int CompareDoubles(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

// The median of v[0..n), v left as it is.
static double Median(const double* v, int n) {
  double* copy = malloc(sizeof(double) * (size_t)n);
  memcpy(copy, v, sizeof(double) * (size_t)n);
  qsort(copy, (size_t)n, sizeof(double), CompareDoubles);
  const double m = copy[n / 2];
  free(copy);
  return m;
}
