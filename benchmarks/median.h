// The median of per-round times (or ratios), and the per-way report, shared by the protocol
// benchmarks here (hop_protocol.c, exchange_protocol.c).
#pragma once

#include <stdio.h>
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

// Prints, per way, the median time per `unit` and its speed against way 0's (`reference`):
// the median of the rounds' ratios and their range. `t` holds ways x rounds times, way-major.
static void ReportWays(const double* t, int ways, int rounds, const char* const* names,
                       const char* unit, const char* reference) {
  const int n = rounds < 256 ? rounds : 256;
  for (int way = 0; way < ways; ++way) {
    double ratios[256];
    double lo = 1e30, hi = 0;
    for (int r = 0; r < n; ++r) {
      ratios[r] = t[r] / t[way * rounds + r];
      if (ratios[r] < lo) lo = ratios[r];
      if (ratios[r] > hi) hi = ratios[r];
    }
    printf("  %-10s %10.2f us a %s, x%.2f of %s's speed (rounds x%.2f-x%.2f)\n", names[way],
           Median(t + way * rounds, rounds) * 1e6, unit, Median(ratios, n), reference, lo, hi);
  }
}
